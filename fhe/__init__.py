"""cipherlm's encrypted path: CKKS backend, encrypted linear algebra and attention, approximations, plans.

Safe recipes are exported here; raw CKKS operations live in :mod:`fhe.hazmat`. Errors: :mod:`fhe.errors`.
"""

from fhe.approx import ScoreApprox
from fhe.attention import BlockClient, EncryptedAttentionLayer, EncryptedKVCache, required_rotation_steps
from fhe.backend import CKKSBackend
from fhe.bundle import BundleError, read_bundle, write_bundle
from fhe.ckks import CKKSClient, ServerKeys
from fhe.envelope import Envelope, EnvelopeError
from fhe.errors import FHEError, KeyMismatchError, SecretKeyRefusedError, ShapeError, WireError
from fhe.params import CKKSParams, ckks_params_for
from fhe.plan import LayerPlan, Plan, PlanError
from fhe.simulator import SimulatedBackend, finish, simulate_block

__all__ = [
    "BlockClient",
    "BundleError",
    "CKKSBackend",
    "CKKSClient",
    "CKKSParams",
    "EncryptedAttentionLayer",
    "EncryptedKVCache",
    "Envelope",
    "EnvelopeError",
    "FHEError",
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
    "finish",
    "read_bundle",
    "required_rotation_steps",
    "simulate_block",
    "write_bundle",
]
