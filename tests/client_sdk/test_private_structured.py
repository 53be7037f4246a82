"""Encrypted tenants' structured output: the SDK builds the same grammar processor as the server.

The client owns the logits in encrypted mode, so the grammar's token mask must run in the SDK. This test
drives the SDK's own request preparation (``client_sdk._private.prepare_job``, the path
``Client.chat.completions.create`` takes in encrypted mode) on a runtime whose bundle is the tiny model
with SmolLM2's tokenizer, set in place of a downloaded one (no server, no CKKS: those parts are covered by
the end-to-end tests), and compares its processor's masks with the server's.
"""

from __future__ import annotations

import json

import pytest
import torch

from client_sdk import Client
from client_sdk._exceptions import PrivateModeError
from client_sdk._private import PrivateRuntime, prepare_job
from client_sdk._protocol import Manifest
from engine import openai_api
from engine.logits_process import new_bitmask
from engine.model import DenseKVCache
from engine.sampler import Sampler, SamplingRow
from engine.structured import GrammarProcessor, model_compiler
from tests.server.app_helpers import tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
          "required": ["ok", "n"]}
BODY = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 32,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}


@pytest.fixture
def runtime(tiny_loaded):  # noqa: F811
    model, tok = tiny_loaded
    rt = PrivateRuntime(Client(api_key="clm-unused", base_url="http://127.0.0.1:9"), key_id="k1")
    rt.manifest = Manifest("tiny", "h", {}, (1,), {}, "sha", 0, 4096, 64, 1 << 30)
    rt.model, rt.tokenizer, rt._tenant_limits = model, tok, {}
    return rt


def test_sdk_builds_the_servers_grammar_processor(runtime, tiny_loaded):  # noqa: F811
    model, tok = tiny_loaded
    job = prepare_job(runtime, "/v1/chat/completions", dict(BODY))
    [sdk] = job.params.logits_processors
    server = openai_api.sampling_params(BODY, chat=True, max_tokens=32,
                                        grammars=model_compiler(tok, model.config)).logits_processors[0]
    assert isinstance(sdk, GrammarProcessor) and isinstance(server, GrammarProcessor)
    for text in ["", '{"ok": ', '{"ok": true, "n": 2}']:
        masks = []
        for proc in (sdk, server):
            mask = new_bitmask(1, model.config.vocab_size)
            proc.fill_bitmask([[]], [tok.encode_plain(text)], mask, [0])
            masks.append(mask)
        assert torch.equal(*masks) and not torch.equal(masks[0], new_bitmask(1, model.config.vocab_size))


def test_sdk_sampler_loop_writes_valid_json(runtime, tiny_loaded):  # noqa: F811
    """The SDK's sampling (engine.Sampler over the client's logits rows) with the job's processor."""
    model, tok = tiny_loaded
    job = prepare_job(runtime, "/v1/chat/completions", {**BODY, "temperature": 1.0, "seed": 3})
    sampler, out = Sampler(torch.Generator().manual_seed(0)), []
    with torch.no_grad():
        for _ in range(32):
            ids = job.ids + out   # the whole history each step: a dense reference, not a fast loop
            cache = DenseKVCache(model.config, len(ids))
            logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1:])
            tok_id = sampler(logits, [SamplingRow(job.params, job.ids, out)]).token_ids[0]
            if tok_id == tok.eos_token_id:
                break
            out.append(tok_id)
    parsed = json.loads(tok.decode(out))
    assert set(parsed) == {"ok", "n"} and parsed["n"] in (1, 2)


def test_sdk_refuses_a_bad_schema_naming_the_field(runtime):
    body = {**BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": []}}}}
    with pytest.raises(PrivateModeError) as info:
        prepare_job(runtime, "/v1/chat/completions", body)
    assert info.value.param == "response_format.json_schema.schema"
