"""A legal step is never refused for its ciphertext count: the envelope bound the service parses with covers
the largest step its deployment takes (``PrivateService.max_step_blobs``). The shipped offload plan on
SmolLM2's shapes carries 72 ciphertexts in a 64-position ``attn_qkv`` step (9 chunk tiles per 8 positions),
the fused plan 264 in a ``down_qkv`` step; both were 400 ``bad_envelope`` when the envelope's bound was a
fixed 64. Real service, registry and audit log over an unstarted pool; steps are checked, not run."""

from __future__ import annotations

import secrets

import pytest

from fhe import envelope
from fhe.fingerprint import params_hash
from fhe.offload import OffloadPlan, default_offload_path, with_fused
from fhe.offload_steps import MLP_PARAMS
from server.errors import InvalidRequestError
from server.keys import EvalKeyStorage, KeyRegistry, RegistryConfig
from server.private.config import PrivateSettings
from server.private.feature import open_audit
from server.private.offload import OffloadSteps
from server.private.service import PrivateService
from server.private.sessions import Session
from server.private.workers import WorkerPool

MLP_FP = "ab" * 32


@pytest.fixture()
def service(tmp_path):
    def make(offload: OffloadPlan | None = None, **cfg) -> PrivateService:
        root = tmp_path / secrets.token_hex(4)
        audit = open_audit(root / "audit", secrets.token_bytes(32), 64)
        registry = KeyRegistry(RegistryConfig(state_path=root / "registry.json"), audit,
                               EvalKeyStorage(root / "material", secrets.token_bytes(32)))
        pool = WorkerPool(1, "tests.server.worker_states:make_probe", ("t",))
        svc = PrivateService(PrivateSettings(workers=1, **cfg), "plan", (), pool, registry, audit)
        svc.offload = None if offload is None else OffloadSteps.of(offload)
        return svc
    return make


def _session(svc: PrivateService) -> Session:
    s = Session(svc.sessions.new_id(), "t", None, 1, None, 0, 0.0, 0.0, mlp_fingerprint=MLP_FP)
    svc.sessions.add(s)
    return s


def _step(s: Session, layer: int, part: str, count: int, blobs: int) -> bytes:
    return envelope.Envelope(s.id, MLP_FP, layer, "prefill", (0, count), (b"c" * 16,) * blobs, "seal",
                             params_hash(MLP_PARAMS), part).to_bytes()


@pytest.mark.parametrize("fused", [False, True], ids=["four steps", "fused"])
def test_every_part_of_the_shipped_offload_plan_at_max_step_tokens_passes_the_envelope_bound(service, fused):
    plan = OffloadPlan.load(default_offload_path())
    svc = service(with_fused(plan, fused))
    s, n = _session(svc), svc.cfg.max_step_tokens
    widest = 0
    for layer, part in sorted(svc.offload.steps):
        want = svc.offload.blobs(part, n)[0]
        env = svc._parse(_step(s, layer, part, n, want))
        svc.offload.check_step(s, env, svc.cfg)        # the part's own check: exactly ``want`` ciphertexts
        widest = max(widest, want)
    assert widest > envelope.MAX_BLOBS                  # the case the fixed bound refused
    assert svc.max_step_blobs() == widest
    layer, part = min(svc.offload.steps)
    with pytest.raises(InvalidRequestError, match="bad envelope") as e:   # one more than any legal step
        svc._parse(_step(s, layer, part, n, widest + 1))
    assert e.value.code == "bad_envelope"


def test_an_attention_deployment_takes_max_step_tokens_ciphertexts(service):
    svc = service(max_step_tokens=100)
    s = Session(svc.sessions.new_id(), "t", "k", 1, "cd" * 32, 0, 0.0, 0.0)
    body = envelope.Envelope(s.id, s.fingerprint, 0, "prefill", (0, 100), (b"c" * 16,) * 100).to_bytes()
    assert len(svc._parse(body).blobs) == 100
    assert service().max_step_blobs() == envelope.MAX_BLOBS   # 64 tokens: the default bound
