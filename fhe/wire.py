"""Moved to :mod:`fhe.backends.seal.wire` (SEAL's serialized objects in the cipherlm blob envelope).

This name stays, as an alias of that module, while the SDK and the private service still import it; new
code imports the backend module.
"""

import sys

from fhe.backends.seal import wire as _wire

sys.modules[__name__] = _wire
