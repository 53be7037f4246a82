"""Moved to :mod:`fhe.backends.seal.hazmat` (raw SEAL operations; no safety checks).

``from fhe.hazmat import seal`` keeps working while other code still uses it; new code imports the
backend module. Use :mod:`fhe.evaluator` (through :func:`fhe.backends.evaluator_for`) unless you know the
level and scale of every operand.
"""

import sys

from fhe.backends.seal import hazmat as seal

sys.modules.setdefault("fhe.hazmat.seal", seal)

__all__ = ["seal"]
