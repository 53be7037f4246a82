"""Structured output (engine/structured.py): grammars compiled by xgrammar, applied as a token bitmask.

The model is a random 2-layer Llama with SmolLM2's real tokenizer and vocabulary, so the grammar works on
the real 49152-token vocabulary while a step costs milliseconds. The schemas have finite languages
(enums, booleans, bounded integers and arrays), so a constrained random model must finish inside
max_tokens — with ``finish_reason == "stop"``, which is only possible where the grammar allowed EOS.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
import torch

from engine import openai_api
from engine.llm import LLM
from engine.logits_process import BanTokens, apply_logits_processors, new_bitmask
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.structured import GrammarError, GrammarSpec, choice_spec, model_compiler
from tests.engine.test_llm import cpu_config
from tests.server.app_helpers import tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)

PERSON = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]},
    },
    "required": ["color", "ok", "age", "tags", "pet"],
}
PROMPTS = ["Describe a person as JSON:", "Give me data", "x", "The weather today is"]


@pytest.fixture(scope="module")
def llm(tiny_loaded):  # noqa: F811
    model, tok = tiny_loaded
    return LLM(model, tokenizer=tok, engine_config=cpu_config(max_num_batched_tokens=256, num_kv_blocks=256))


@pytest.fixture(scope="module")
def grammars(tiny_loaded):  # noqa: F811
    model, tok = tiny_loaded
    return model_compiler(tok, model.config)


def _params(body: dict, grammars, max_tokens: int = 80) -> SamplingParams:
    return openai_api.sampling_params(body, chat=True, max_tokens=max_tokens, grammars=grammars)


def _texts(llm, body, grammars, prompts=PROMPTS, **kw):
    outs = llm.generate(prompts, [_params({**body, **kw}, grammars) for _ in prompts])
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_validate_greedy_and_sampled_batched(llm, grammars, temperature):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                       "strict": True}},
            "temperature": temperature, "seed": 3, "n": 2}
    validator = jsonschema_rs.validator_for(PERSON)
    for c in _texts(llm, body, grammars):
        assert c.finish_reason == "stop", c.text
        validator.validate(json.loads(c.text))


def test_unconstrained_random_model_does_not_write_json(llm, grammars):
    """The control: without the grammar the same requests produce no valid JSON (the test can fail)."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(o.outputs[0].text)


def test_json_object_choice_regex_and_grammar(llm, grammars):
    cases = [
        ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_grammar": 'root ::= "(" ("a" | "b")? ")"'}, lambda t: t in ("()", "(a)", "(b)")),
        ({"guided_json": json.dumps({"enum": [1, 2, "three"]})}, lambda t: json.loads(t) in (1, 2, "three")),
    ]
    for body, ok in cases:
        for c in _texts(llm, {**body, "temperature": 1.0, "seed": 5}, grammars):
            assert c.finish_reason == "stop" and ok(c.text), (body, c.text)


def test_json_object_is_an_object(llm, grammars):
    for c in _texts(llm, {"response_format": {"type": "json_object"}, "temperature": 0}, grammars):
        # an open-ended grammar: a random model may not close it in 80 tokens, but what it wrote so far
        # is the start of an object, and a finished one parses
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_grammar_survives_preemption(tiny_loaded, grammars):  # noqa: F811
    """Preemption recomputes a sequence; its matcher state follows the token history, not a sequence id."""
    model, tok = tiny_loaded
    llm = LLM(model, tokenizer=tok, engine_config=cpu_config(num_kv_blocks=34))
    body = {"guided_json": PERSON, "temperature": 1.0, "seed": 9}
    validator = jsonschema_rs.validator_for(PERSON)
    for c in _texts(llm, body, grammars, prompts=PROMPTS * 2):
        assert c.finish_reason == "stop", c.text
        validator.validate(json.loads(c.text))
    assert llm.engine.scheduler.num_preemptions > 0


def test_unconstrained_row_in_a_constrained_batch_is_untouched(llm, grammars):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = llm.generate([PROMPTS[1]], plain)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS[:3], [_params({"guided_choice": ["yes"]}, grammars), plain,
                                       _params({"guided_json": PERSON}, grammars)])
    assert mixed[0].outputs[0].text == "yes"
    assert mixed[1].outputs[0].token_ids == solo


def test_eos_only_where_the_grammar_may_end(tiny_loaded, grammars):  # noqa: F811
    _, tok = tiny_loaded
    proc = grammars.processor(choice_spec(["yes", "yes!"]))
    eos = tok.eos_token_id
    histories = [[], tok.encode_plain("yes"), tok.encode_plain("yes!")]
    rows = [SamplingRow(SamplingParams(logits_processors=[proc]), [1], h) for h in histories]
    logits = apply_logits_processors(torch.zeros(3, grammars.vocab_size), rows)
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert eos not in allowed[0] and eos in allowed[1] and allowed[2] == {eos}
    assert tok.encode_plain("!")[0] in allowed[1]


def test_bitmask_applies_after_other_processors_and_intersects(tiny_loaded, grammars):  # noqa: F811
    _, tok = tiny_loaded
    yes = tok.encode_plain("yes")[0]
    proc = grammars.processor(choice_spec(["yes", "no"]))
    boost = lambda ids, row: row.fill_(1e9)  # noqa: E731 - a processor that tries to allow everything
    rows = [SamplingRow(SamplingParams(logits_processors=[proc, boost]), [], []),
            SamplingRow(SamplingParams(logits_processors=[proc, BanTokens([yes]),
                                                          grammars.processor(choice_spec(["yes", "ok"]))]),
                        [], [])]
    logits = apply_logits_processors(torch.zeros(2, grammars.vocab_size), rows)
    first = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    second = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert yes in first and len(first) < 10   # the boost could not re-enable what the grammar forbids
    assert yes not in second and not second & set(tok.encode_plain("no")) - {yes}


def test_torch_and_xgrammar_masking_agree(grammars):
    proc = grammars.processor(GrammarSpec("json_schema", json.dumps(PERSON)))
    bitmask = new_bitmask(2, grammars.vocab_size)
    proc.fill_bitmask([[]], [[]], bitmask, [1])
    a, b = torch.randn(2, grammars.vocab_size), None
    b = a.clone()
    type(proc).apply_bitmask(a, bitmask, [1])
    type(proc).__mro__[1].apply_bitmask(b, bitmask, [1])   # the torch reference of the base class
    assert torch.equal(a, b) and torch.isfinite(a[0]).all() and not torch.isfinite(a[1]).all()


def test_compilation_is_cached_per_schema_and_happens_before_the_step(llm, grammars):
    body = {"guided_json": {**PERSON, "title": "cache-test"}}
    before = grammars.misses
    params = [_params(body, grammars) for _ in range(3)]
    assert grammars.misses == before + 1                       # one compile for three requests
    assert len({id(p.logits_processors[0]) for p in params}) == 3  # each request has its own matcher state
    llm.generate(PROMPTS[:3], params)
    assert grammars.misses == before + 1                       # nothing compiled inside the steps


def test_replayed_history_matches_the_incremental_state(tiny_loaded, grammars):  # noqa: F811
    _, tok = tiny_loaded
    text = '{"color": "red", "ok": true, "age": 4'
    ids = tok.encode_plain(text)
    stepwise = grammars.processor(GrammarSpec("json_schema", json.dumps(PERSON)))
    for i in range(len(ids) + 1):
        mask_a = new_bitmask(1, grammars.vocab_size)
        stepwise.fill_bitmask([[]], [ids[:i]], mask_a, [0])
    fresh = grammars.processor(GrammarSpec("json_schema", json.dumps(PERSON)))
    mask_b = new_bitmask(1, grammars.vocab_size)
    fresh.fill_bitmask([[]], [ids], mask_b, [0])
    assert torch.equal(mask_a, mask_b) and not torch.equal(mask_b, new_bitmask(1, grammars.vocab_size))


# --- bad input: a typed error naming the field, before any work -------------------------------------

BAD = [
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json", "properties must be an object"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": 5}, "guided_json", "JSON schema object"),
    ({"guided_regex": "a["}, "guided_regex", "Unclosed"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_grammar": 'x ::= "a"'}, "guided_grammar", "root"),
    ({"guided_choice": []}, "guided_choice", "list of 1"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "non-empty strings"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}},
     "response_format.json_schema.strict", "true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "foo"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"guided_regex": "a" * (64 * 1024 + 1)}, "guided_regex", "longer than"),
    ({"guided_regex": "(" * 2000 + "a" + ")" * 2000}, "guided_regex", "maximum"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_bad_structured_fields_are_typed_errors_naming_the_field(grammars, body, param, words):
    with pytest.raises(openai_api.OpenAIRequestError) as info:
        openai_api.check_fields(body, chat=True)
        _params(body, grammars)
    assert info.value.param == param and words in str(info.value)
    assert "/project/cpp" not in str(info.value)   # xgrammar's source paths are not shown to clients


def test_deeply_nested_schema_is_refused_without_recursion(grammars):
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(openai_api.OpenAIRequestError, match="nested deeper"):
        openai_api.check_fields({"guided_json": schema}, chat=True)


def test_text_format_and_no_compiler(grammars):
    assert _params({"response_format": {"type": "text"}}, grammars).logits_processors == []
    with pytest.raises(openai_api.OpenAIRequestError, match="not available") as info:
        openai_api.sampling_params({"guided_regex": "a"}, chat=False, max_tokens=4)
    assert info.value.param == "guided_regex"


def test_grammar_error_is_cached_and_typed(grammars):
    spec = GrammarSpec("regex", "(unclosed", "guided_regex")
    for _ in range(2):
        with pytest.raises(GrammarError) as info:
            grammars.compile(spec)
        assert info.value.param == "guided_regex"
    hits = grammars.hits
    with pytest.raises(GrammarError):
        grammars.compile(spec)
    assert grammars.hits == hits + 1
