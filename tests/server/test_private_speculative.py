"""Speculative decoding under encryption, end to end on real parts: the SDK's private runtime against the
real app (tiny model, the one-layer 2Quad plan at N = 16384, real SEAL keys, a real worker process).

* greedy output with speculation is the same as without: the plan's simulated greedy tokens (the random
  tiny model repeats itself, so n-gram drafts are proposed, some accepted and some rejected: both the
  rollback and the no-rollback path run);
* the ``rollback`` message: retry-safe, and a typed refusal for a rollback beyond the layer's cache
  (400 ``bad_rollback``) or into committed positions (409 ``rollback_refused``), the session still usable.
"""

from __future__ import annotations

import pytest

from client_sdk import APIStatusError, BadRequestError, Client
from client_sdk._private import runtime_of
from client_sdk._runtime import StepStats
from client_sdk._speculate import Speculation
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 (fixture)
from tests.server.private_helpers import encrypted_client, tiny_plan

pytestmark = pytest.mark.slow   # ~1 min of CKKS on 2 busy cores (key generation, ~24 encrypted positions)

KEY = "clm-speculative-enc-000000000"
# Four tokens (the rollback test reads ids[3]): every prompt token is an encrypted position in each of the four
# generations here, and the checks do not depend on the prompt's length. The random model's greedy answer repeats
# one token (so n-gram drafts are proposed) with a top-2 logit gap of 0.055 in the plan's simulator (0.051 for the
# seven-token "one two three one two three one" used until session 22).
PROMPT = "one two three one"


@pytest.fixture(scope="module")
def enc(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """An encrypted-mode Client on the app (its lifespan and worker run for the module)."""
    with encrypted_client(tiny_model_dir, tmp_path_factory, KEY, max_session_tokens=64, max_step_tokens=4,
                          max_step_bytes=32 << 20) as (client, _):   # real ciphertexts (the helper's cap is for probes)
        yield client


def _greedy(client: Client, k: int) -> str:
    out = client.completions.create(prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"num_speculative_tokens": k, "ignore_eos": True})
    return out.choices[0].text


class _PlanSimulator:
    """The plan's simulator with the ``logits(ids)`` that :func:`tests.server.private_app.greedy_with_gap` takes."""

    def __init__(self, model_dir, plan_path) -> None:
        from engine.loader import load_model
        from fhe.plan import Plan
        from fhe.simulator import simulated_model

        self.plan = Plan.load(plan_path)
        self.model = simulated_model(load_model(model_dir), self.plan)

    def logits(self, ids: list[int]):
        from fhe.simulator import sequence_logits

        return sequence_logits(self.model, ids, self.plan)


def _plain_greedy(model_dir, folder) -> str:
    """What non-speculative greedy decoding of the plan answers: its simulator's 5 greedy tokens (the
    approximated model without CKKS noise; the SDK's plain decoding equals it, tests/e2e and
    tests/client_sdk/test_private_parity.py). Not an encrypted k = 0 run: that was 5 more encrypted
    positions (~15 s) for the same reference; whether k = 0 speculates is tests/client_sdk/test_speculate.py's."""
    from engine.tokenizer import Tokenizer
    from tests.server.private_app import greedy_with_gap

    sim = _PlanSimulator(model_dir, tiny_plan(model_dir, folder / "tiny.plan.json"))   # the server's plan
    tok = Tokenizer.from_folder(model_dir)
    out, gap = greedy_with_gap(sim, tok.encode(PROMPT), 5)
    assert gap > 1e-2, "the simulator's greedy choice is a near-tie: CKKS noise could flip it"
    return tok.decode(out)


def test_speculative_greedy_output_is_the_non_speculative_output(enc, tiny_model_dir, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    from engine.spec_decode import NgramProposer

    plain = _plain_greedy(tiny_model_dir, tmp_path)
    spec = _greedy(enc, 3)
    s = runtime_of(enc).last_speculation.decoder
    assert spec == plain
    assert s.num_drafts > 0 and s.num_draft_tokens > 0        # drafts were proposed and verified
    # drafts that are wrong (the random model repeats tokens, so not the last one: its successor id):
    # every verify step ends in a rejection and a rollback of the server's caches
    monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k: [ids[-1] + 1] * k)
    assert _greedy(enc, 3) == plain
    s = runtime_of(enc).last_speculation.decoder
    assert s.num_drafts >= 3 and s.num_accepted_tokens < s.num_draft_tokens


def test_the_client_default_switches_it_on(enc):
    rt = runtime_of(enc)
    rt.num_speculative_tokens = 3
    try:
        enc.completions.create(prompt=PROMPT, max_tokens=3, temperature=0.8, seed=5)   # sampled: it runs
        assert rt.last_speculation is not None and rt.last_speculation.k == 3
    finally:
        rt.num_speculative_tokens = 0


def test_rollback_messages_are_checked_and_retry_safe(enc):
    from client_sdk._runtime import EncryptedBackend
    from engine.model import DenseKVCache

    rt = runtime_of(enc)
    rt.prepare()                       # on its own too, not only after another test generated
    ids = rt.tokenizer.encode(PROMPT)
    rt.open_session()
    backend = EncryptedBackend(rt, DenseKVCache(rt.model.config, rt.max_len()), StepStats())
    rt.forward(backend, ids, 0)
    n = len(ids)
    spec = Speculation(rt, 3)
    layer, session = rt.layers[0], rt.session
    with pytest.raises(APIStatusError) as refused:            # no verify step yet: all committed
        rt.exchange(session.rollback_call(layer, n - 1, 1))
    assert (refused.value.status_code, refused.value.code) == (409, "rollback_refused")
    rows = spec.verify_forward(backend, ids[:3], n)          # positions n .. n+2
    assert rows.shape[0] == 3
    with pytest.raises(BadRequestError) as bad:              # keep + dropped is not where the layer stands
        rt.exchange(session.rollback_call(layer, n + 1, 5))
    assert bad.value.code == "bad_rollback"
    with pytest.raises(APIStatusError) as refused:            # before the verify step's first position
        rt.exchange(session.rollback_call(layer, n - 1, 4))
    assert (refused.value.status_code, refused.value.code) == (409, "rollback_refused")
    call = session.rollback_call(layer, n + 1, 2)
    first, again = rt.exchange(call), rt.exchange(call)      # a retry gets the same answer
    assert first.content == again.content
    session.rollback_done(first, layer, n + 1, 2)
    backend.cache.truncate(n + 1)
    logits = rt.forward(backend, ids[3:4], n + 1)            # decoding goes on at the kept length
    assert logits.shape[-1] == rt.model.config.vocab_size
    with pytest.raises(APIStatusError):                       # the decode step made everything final
        rt.exchange(session.rollback_call(layer, n + 1, 1))
    rt.close_session()
