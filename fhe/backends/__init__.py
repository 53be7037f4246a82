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
from fhe.fingerprint import params_hash
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


def describe(params: CKKSParams, name: str = DEFAULT_BACKEND) -> dict:
    """What a manifest publishes about the evaluation: the backend (ciphertext and key format) and the
    parameter set with its hash (what envelopes name in ``backend`` / ``params``)."""
    return {"name": name, "params": params.to_dict(), "params_hash": params_hash(params)}


def check_backend(declared: str, declared_params: str, *, name: str, params: CKKSParams) -> None:
    """BackendMismatchError unless a request made for backend ``declared`` and parameter hash
    ``declared_params`` ("" = not stated) fits a server running ``name`` with ``params``."""
    if declared != name:
        raise BackendMismatchError(f"request made for backend {declared!r}, this server evaluates {name!r}")
    if declared_params and declared_params != params_hash(params):
        raise BackendMismatchError(f"request made for CKKS parameters {declared_params[:16]}..., this server "
                                   f"runs {params_hash(params)[:16]}... (N = {params.poly_modulus_degree}); "
                                   "fetch the manifest again and make keys for it")


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "check_backend", "describe", "evaluator_for"]
