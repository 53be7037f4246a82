"""Evaluator backends behind :mod:`fhe.evaluator`, picked by name.

``seal`` (Microsoft SEAL through ``tenseal.sealapi``: the CPU server backend and the client's keys),
``symbolic`` (levels and scales checked symbolically with plaintext values inside: tests only, no
encryption) and, when installed, ``gpu`` (issue 16). Backends are imported lazily, so nothing above the
seam imports a CKKS library.
"""

from __future__ import annotations

import importlib

from fhe.errors import BackendMismatchError
from fhe.evaluator import Evaluator
from fhe.params import CKKSParams

#: backend name -> module defining ``make_evaluator(params) -> Evaluator``.
BACKENDS = {"seal": "fhe.backends.seal", "symbolic": "fhe.backends.symbolic", "gpu": "fhe.backends.gpu"}
#: The backend a plan runs on when nothing else is said (what SEAL clients' ciphertexts are made for).
DEFAULT_BACKEND = "seal"


def evaluator_for(params: CKKSParams, name: str = DEFAULT_BACKEND) -> Evaluator:
    """An evaluator of backend ``name`` for ``params`` (BackendMismatchError for an unknown name)."""
    if name not in BACKENDS:
        raise BackendMismatchError(f"unknown evaluator backend {name!r} (known: {sorted(BACKENDS)})")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as exc:
        raise BackendMismatchError(f"evaluator backend {name!r} is not available here: {exc}") from exc
    return module.make_evaluator(params)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "evaluator_for"]
