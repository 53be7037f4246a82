"""End to end on a gpu-backend server (issue 16, session 22): the SDK's private runtime against the real app whose
worker runs the gpu backend (its torch-CPU reference; tiny model, the one-layer 2Quad plan, real SEAL keys, a real
worker process). The manifest names no upload form, so the SDK sends attention steps in SEAL's seeded form, on
seeded encryptions of zero made ahead (half a full upload's bytes); the worker expands each c1 on its device
(:mod:`fhe.backends.gpu.uniform`), and the greedy tokens are the plan's simulated ones, which the SEAL server's are
too (tests/server/test_private_speculative.py, tests/e2e)."""

from __future__ import annotations

import pytest

from client_sdk._private import runtime_of
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 (fixture)
from tests.server.private_helpers import encrypted_client, tiny_plan

pytestmark = pytest.mark.slow   # keys and ~4 encrypted positions on the torch-CPU reference (~4 min, 2 cores)

KEY = "clm-device-e2e-enc-0000000000"
PROMPT = "one two"
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def enc(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """An encrypted-mode Client on the app with a gpu-backend worker (its lifespan and worker run for the module)."""
    with encrypted_client(tiny_model_dir, tmp_path_factory, KEY, max_session_tokens=32, max_step_tokens=4,
                          max_step_bytes=32 << 20, device="cpu-reference") as pair:
        yield pair


# ~130 s on 2 cores (the torch-CPU reference's Blake2xb and block): heavy, since the default run checks its parts:
# the seeded upload read into the ciphertext SEAL's load gives (test_private_device_uploads.py), the SDK's seeded
# encryption on a zero made ahead (tests/client_sdk/test_attention_uploads.py), the expansion = SEAL's
# (tests/fhe/test_gpu_backend_seeded.py) and the gpu backend's packed and token steps = SEAL's
# (tests/fhe/test_gpu_backend_packed_cpu.py)
@pytest.mark.heavy
def test_seeded_attention_uploads_to_a_gpu_worker_give_the_plans_greedy_tokens(enc, tiny_model_dir, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    import numpy as np

    from client_sdk._zeros import ZerosAhead
    from engine.tokenizer import Tokenizer
    from fhe.backends.seal import wire
    from tests.server.private_app import greedy_with_gap
    from tests.server.test_private_speculative import _PlanSimulator

    client, http = enc
    sent, real = [], ZerosAhead.encrypt_to_wire
    monkeypatch.setattr(ZerosAhead, "encrypt_to_wire",
                        lambda self, values: sent.append((self.seeded, blob := real(self, values))) or blob)
    out = client.completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
    rt = runtime_of(client)
    man = http.get("/v1/private/manifest", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "upload" not in man and rt.manifest.upload == "seeded"
    full = len(wire.encrypt_to_wire(rt.ckks, np.zeros(rt.ckks.params.slots), seeded=False))
    assert sent and all(seeded and len(blob) < 0.6 * full for seeded, blob in sent)
    sim = _PlanSimulator(tiny_model_dir, tiny_plan(tiny_model_dir, tmp_path / "tiny.plan.json"))
    tok = Tokenizer.from_folder(tiny_model_dir)
    want, gap = greedy_with_gap(sim, tok.encode(PROMPT), MAX_TOKENS)
    assert gap > 1e-2, "the simulator's greedy choice is a near-tie: CKKS noise could flip it"
    assert out.choices[0].text == tok.decode(want)
