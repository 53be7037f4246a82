"""cipherlm's encrypted path: CKKS evaluation behind one protocol, encrypted linear algebra and attention,
approximations, plans.

Safe recipes are exported here; the evaluator protocol is :mod:`fhe.evaluator`, its backends live in
:mod:`fhe.backends` (SEAL: :mod:`fhe.backends.seal`, raw operations in its ``hazmat``). Errors:
:mod:`fhe.errors`. The SEAL-backed key holders (``CKKSClient``, ``ServerKeys``) load lazily, so importing
the block does not load a library.
"""

from fhe.approx import ScoreApprox
from fhe.attention import (
    BlockClient,
    EncryptedAttentionLayer,
    EncryptedKVCache,
    required_key_levels,
    required_rotation_steps,
)
from fhe.bundle import BundleError, read_bundle, write_bundle
from fhe.envelope import Envelope, EnvelopeError
from fhe.errors import (
    BackendMismatchError,
    FHEError,
    KeyMismatchError,
    SecretKeyRefusedError,
    ShapeError,
    WireError,
)
from fhe.evaluator import EvalKeys, Evaluator, KeyHolder
from fhe.params import CKKSParams, KeyLevels, ckks_params_for
from fhe.plan import LayerPlan, Plan, PlanError
from fhe.simulator import SimulatedBackend, finish, simulate_block

_LAZY = {"CKKSClient": "fhe.backends.seal.keys", "ServerKeys": "fhe.backends.seal.keys",
         "evaluator_for": "fhe.backends"}


def __getattr__(name: str):
    """The SEAL-backed names, imported on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fhe' has no attribute {name!r}")


__all__ = [
    "BackendMismatchError",
    "BlockClient",
    "BundleError",
    "CKKSClient",
    "CKKSParams",
    "EncryptedAttentionLayer",
    "EncryptedKVCache",
    "Envelope",
    "EnvelopeError",
    "EvalKeys",
    "Evaluator",
    "FHEError",
    "KeyHolder",
    "KeyLevels",
    "KeyMismatchError",
    "LayerPlan",
    "Plan",
    "PlanError",
    "ScoreApprox",
    "SecretKeyRefusedError",
    "ServerKeys",
    "ShapeError",
    "SimulatedBackend",
    "WireError",
    "ckks_params_for",
    "evaluator_for",
    "finish",
    "read_bundle",
    "required_key_levels",
    "required_rotation_steps",
    "simulate_block",
    "write_bundle",
]
