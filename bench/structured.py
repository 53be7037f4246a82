"""Structured output on the real default model (SmolLM2-135M-Instruct, CPU): validity and per-token cost.

Measures, in one run:
1. validity: 10 JSON schemas (nesting, enums, arrays, required fields, bounded integers, string patterns)
   × 5 chat prompts = 50 pairs, all in one batch, through the same translation the server uses
   (``response_format: json_schema``); every output is parsed and validated with ``jsonschema_rs``;
2. per-token overhead at batch 32: the same 32 prompts decoded for ``--tokens`` tokens (EOS ignored)
   unconstrained and with a grammar per request (a schema whose language is longer than ``--tokens``,
   so every row stays constrained at every step), alternating ``--repeats`` times; the median of each,
   as seconds per generated token;
   the best of the repeats too, and the time the grammar processors alone take on the batch's real token
   histories (the part of the overhead other jobs on the machine cannot blur);
3. compile cost: the first compile of each schema and a cached one.

The load average is recorded at the start and the end (other jobs skew CPU figures).

Usage: python bench/structured.py [--threads 2] [--tokens 48] [--repeats 3] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jsonschema_rs
import torch

from engine import openai_api
from engine.default_model import default_model_dir
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured import model_compiler

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_TEXT = {"type": "string", "maxLength": 60}

SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "hobbies": {"type": "array", "items": _NAME, "maxItems": 3}},
        "required": ["name", "age", "email", "hobbies"]},
    "address": {"type": "object", "properties": {
        "name": _NAME, "address": {"type": "object", "properties": {
            "street": _TEXT, "city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]},
    "product": {"type": "object", "properties": {
        "title": _TEXT, "price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "in_stock": {"type": "boolean"}, "category": {"enum": ["books", "toys", "food", "tools"]}},
        "required": ["title", "price_cents", "in_stock", "category"]},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": _NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "quantity"]}},
        "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["order_id", "items", "status"]},
    "event": {"type": "object", "properties": {
        "title": _TEXT, "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": _NAME, "maxItems": 4},
        "online": {"type": "boolean"}},
        "required": ["title", "date", "attendees", "online"]},
    "review": {"type": "object", "properties": {
        "rating": {"enum": [1, 2, 3, 4, 5]}, "summary": _TEXT,
        "recommend": {"type": "boolean"}},
        "required": ["rating", "summary", "recommend"]},
    "weather": {"type": "object", "properties": {
        "city": _NAME, "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
        "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind", "fog"]},
                       "minItems": 1, "maxItems": 3}},
        "required": ["city", "celsius", "conditions"]},
    "movie": {"type": "object", "properties": {
        "title": _TEXT, "year": {"type": "integer", "minimum": 1900, "maximum": 2026},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror", "sci-fi"]},
                   "maxItems": 3},
        "director": {"type": "object", "properties": {"name": _NAME, "born": {
            "type": "integer", "minimum": 1850, "maximum": 2010}}, "required": ["name"]}},
        "required": ["title", "year", "genres", "director"]},
    "tasks": {"type": "object", "properties": {
        "project": _NAME, "tasks": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "task": _TEXT, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}},
            "required": ["task", "done", "priority"]}}},
        "required": ["project", "tasks"]},
    "settings": {"type": "object", "properties": {
        "theme": {"enum": ["light", "dark"]}, "language": {"enum": ["en", "fr", "de"]},
        "notifications": {"type": "object", "properties": {
            "email": {"type": "boolean"}, "push": {"type": "boolean"},
            "frequency": {"enum": ["daily", "weekly", "never"]}},
            "required": ["email", "push", "frequency"]}},
        "required": ["theme", "language", "notifications"]},
}

PROMPTS: dict[str, list[str]] = {
    "person": ["a software engineer from Lyon", "a retired teacher", "a young chess player",
               "a chef who loves cycling", "you, as an assistant"],
    "address": ["the Eiffel Tower's office", "a bakery in Berlin", "my friend Anna in Boston",
                "a small library", "a fictional wizard's tower"],
    "product": ["a hardcover novel", "a wooden toy train", "a jar of honey", "a cordless drill",
                "a board game"],
    "order": ["two books and a pen", "one coffee machine", "three bags of rice", "a birthday gift order",
              "an order that was just delivered"],
    "event": ["a team meeting in March", "an online Python workshop", "a wedding in June",
              "a charity run", "a book club evening"],
    "review": ["a great pizza place", "a disappointing phone", "an average hotel", "a wonderful museum",
               "a noisy restaurant"],
    "weather": ["a rainy day in London", "a hot afternoon in Cairo", "snow in Oslo", "a windy beach",
                "a foggy morning in San Francisco"],
    "movie": ["a classic science fiction film", "a romantic comedy", "a horror movie from the eighties",
              "an action film", "a drama about a family"],
    "tasks": ["moving to a new flat", "launching a website", "planning a trip", "writing a thesis",
              "cleaning the garage"],
    "settings": ["a user who hates emails", "a night owl who reads French", "default settings",
                 "someone who wants every notification", "a German user with a light theme"],
}

# a language longer than any --tokens: every row of the overhead run stays constrained at every step
LONG = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 64, "maxItems": 64,
                                                   "items": {"type": "string", "minLength": 8, "maxLength": 40}}},
        "required": ["notes"]}


def pairs() -> list[tuple[str, str]]:
    """(schema name, prompt) pairs: 10 × 5 = 50."""
    return [(name, p) for name, prompts in PROMPTS.items() for p in prompts]


def _body(name: str, schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                       "strict": True}}, "temperature": 0}


def _chat(llm: LLM, name: str, prompt: str) -> list[int]:
    keys = ", ".join(SCHEMAS[name]["required"])
    text = f"Reply with a JSON object describing {prompt}. Keys: {keys}."
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def validity(llm: LLM, cases: list[tuple[str, str]], max_tokens: int = 320) -> dict:
    """Generate every case in one batch; parse and validate each output against its schema."""
    grammars = model_compiler(llm.tokenizer, llm.engine.model_config)
    params = [openai_api.sampling_params(_body(n, SCHEMAS[n]), chat=True, max_tokens=max_tokens,
                                         grammars=grammars) for n, _ in cases]
    start = time.perf_counter()
    outs = llm.generate([_chat(llm, n, p) for n, p in cases], params)
    seconds = time.perf_counter() - start
    results = []
    for (name, prompt), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        results.append({"schema": name, "prompt": prompt, "finish_reason": c.finish_reason, "tokens": len(c.token_ids),
                        "error": _check(c.text, SCHEMAS[name]), "text": c.text})
    valid = sum(r["error"] is None for r in results)
    return {"pairs": len(results), "valid": valid, "seconds": seconds,
            "tokens": sum(r["tokens"] for r in results), "results": results}


def _check(text: str, schema: dict) -> str | None:
    try:
        jsonschema_rs.validator_for(schema).validate(json.loads(text))
    except (ValueError, jsonschema_rs.ValidationError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


def overhead(llm: LLM, batch: int, tokens: int, repeats: int) -> dict:
    """Seconds per generated token at ``batch``: unconstrained vs one grammar processor per request."""
    grammars = model_compiler(llm.tokenizer, llm.engine.model_config)
    cases = (pairs() * 2)[:batch]
    prompts = [_chat(llm, n, p) for n, p in cases]
    plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    body = {**_body("notes", LONG), "ignore_eos": True}
    times: dict[str, list[float]] = {"plain": [], "grammar": []}
    for _ in range(repeats):
        for kind in ("plain", "grammar"):
            params = plain if kind == "plain" else [
                openai_api.sampling_params(body, chat=True, max_tokens=tokens, grammars=grammars) for _ in prompts]
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
            times[kind].append(elapsed / (batch * tokens))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    mask = _mask_cost(llm, grammars, body, prompts, [o.outputs[0].token_ids for o in outs], tokens)
    return {"batch": batch, "tokens": tokens, "repeats": repeats, "s_per_token": med, "all": times,
            "overhead": med["grammar"] / med["plain"] - 1, "overhead_min": best["grammar"] / best["plain"] - 1,
            "mask_s_per_token": mask, "mask_share_of_plain": mask / best["plain"]}


def _mask_cost(llm: LLM, grammars, body: dict, prompts, outputs: list[list[int]], tokens: int) -> float:
    """Seconds per token spent in the grammar processors alone: the batch's steps replayed on their real
    token histories (fresh processors, advanced one token per step as in the engine) — the part of the
    overhead that does not depend on the machine's other load."""
    from engine.logits_process import apply_logits_processors
    from engine.sampler import SamplingRow

    params = [openai_api.sampling_params(body, chat=True, max_tokens=tokens, grammars=grammars) for _ in prompts]
    logits = torch.randn(len(prompts), llm.engine.model_config.vocab_size)
    spent = 0.0
    for t in range(tokens):
        rows = [SamplingRow(p, ids, out[:t]) for p, ids, out in zip(params, prompts, outputs, strict=True)]
        x = logits.clone()
        start = time.perf_counter()
        apply_logits_processors(x, rows)
        spent += time.perf_counter() - start
    return spent / (len(prompts) * tokens)


def compile_cost(llm: LLM) -> dict:
    """First and cached compile of each schema (a fresh compiler's cache: the first call is a miss)."""
    from engine.structured import GrammarCompiler, GrammarSpec

    start = time.perf_counter()
    fresh = GrammarCompiler(llm.tokenizer.hf_tokenizer, llm.engine.model_config.vocab_size, [2])
    setup = time.perf_counter() - start
    first, cached = [], []
    for schema in list(SCHEMAS.values()) + [LONG]:
        spec = GrammarSpec("json_schema", json.dumps(schema))
        for out in (first, cached):
            t = time.perf_counter()
            fresh.compile(spec)
            out.append(time.perf_counter() - t)
    return {"tokenizer_info_s": setup, "first_ms_median": 1e3 * statistics.median(first),
            "first_ms_max": 1e3 * max(first), "cached_us_median": 1e6 * statistics.median(cached)}


def _print(report: dict) -> None:
    if "validity" in report:
        v = report["validity"]
        print(f"validity: {v['valid']}/{v['pairs']} parse and validate ({v['tokens']} tokens in {v['seconds']:.1f} s)")
        for r in v["results"]:
            if r["error"]:
                print(f"  INVALID {r['schema']} / {r['prompt']}: {r['error']} ({r['finish_reason']})")
    if "overhead" in report:
        o = report["overhead"]
        print(f"batch {o['batch']}: plain {o['s_per_token']['plain'] * 1e3:.2f} ms/token, grammar "
              f"{o['s_per_token']['grammar'] * 1e3:.2f} ms/token (medians) -> overhead {100 * o['overhead']:+.1f} %"
              f" (best of {o['repeats']}: {100 * o['overhead_min']:+.1f} %); grammar processors alone "
              f"{o['mask_s_per_token'] * 1e3:.3f} ms/token = {100 * o['mask_share_of_plain']:.1f} % of a plain token")
    if "compile" in report:
        print(f"compile: {report['compile']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10 pairs, 16 tokens, 1 repeat")
    ap.add_argument("--skip", action="append", default=[], choices=["compile", "validity", "overhead"])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    llm = LLM(default_model_dir(), engine_config=EngineConfig(device="cpu", max_num_seqs=64,
                                                              max_num_batched_tokens=2048))
    cases = pairs()[::5] if args.quick else pairs()
    tokens, repeats = (16, 1) if args.quick else (args.tokens, args.repeats)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads}
    for part, run in (("compile", lambda: compile_cost(llm)), ("validity", lambda: validity(llm, cases)),
                      ("overhead", lambda: overhead(llm, args.batch, tokens, repeats))):
        if part in args.skip:
            continue
        start = time.perf_counter()
        report[part] = run()
        print(f"[{part}: {time.perf_counter() - start:.0f} s]", flush=True)
    report["load"] = {"start": load_start, "end": os.getloadavg()}
    _print(report)
    print(f"load average: {load_start} -> {report['load']['end']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
