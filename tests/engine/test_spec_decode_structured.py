"""Speculation under a grammar: every draft is checked by the grammar before it is accepted."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from engine import openai_api
from engine import spec_decode as sd
from engine.llm import LLM
from engine.parts import EngineParts
from tests.engine.test_llm import cpu_config
from tests.engine.test_structured import PERSON, PROMPTS
from tests.server.app_helpers import tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)


class _RepeatProposer:
    """Drafts the sequence's last k tokens again: often wrong, sometimes what the grammar allows."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return token_ids[-k:]


class _ForbiddenProposer:
    """Drafts one token again and again (one this schema never allows: it has enum strings only)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [self.token] * k


def _llm(tiny_loaded, proposer) -> LLM:  # noqa: F811
    model, tok = tiny_loaded
    parts = EngineParts(spec_decoder=lambda cfg, n: sd.SpecDecoder(cfg, n, proposer))
    config = cpu_config(num_kv_blocks=256, speculative_disable_by_batch_size=None)
    return LLM(model, tokenizer=tok, engine_config=config, parts=parts)


def _run(llm, grammars, temperature: float, k: int):
    body = {"guided_json": PERSON, "temperature": temperature, "seed": 4, "num_speculative_tokens": k}
    params = [openai_api.sampling_params(body, chat=True, max_tokens=80, grammars=grammars) for _ in PROMPTS]
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def grammars(tiny_loaded):  # noqa: F811
    from engine.structured import model_compiler

    model, tok = tiny_loaded
    return model_compiler(tok, model.config)


@pytest.mark.parametrize("which", ["repeat", "forbidden"])
def test_drafts_pass_the_grammar_greedy_and_sampled(tiny_loaded, grammars, which):  # noqa: F811
    _, tok = tiny_loaded
    proposer = _RepeatProposer() if which == "repeat" else _ForbiddenProposer(tok.encode(" zebra")[0])
    llm = _llm(tiny_loaded, proposer)
    validator = jsonschema_rs.validator_for(PERSON)
    plain = _run(llm, grammars, 0, 0)
    spec = _run(llm, grammars, 0, 6)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for c in spec + _run(llm, grammars, 1.0, 6):
        assert c.finish_reason == "stop", c.text
        validator.validate(json.loads(c.text))
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    if which == "forbidden":  # the grammar turned every draft down
        assert stats.spec_num_accepted_tokens == 0
