"""Speculative decoding under encryption: seconds per output token with and without, same plan, one run.

Real parts: the app (``server.app.create_app``) with the encrypted-session service and a real worker
process, reached in-process through Starlette's ``TestClient`` (an ``httpx.Client`` over the ASGI app: no
loopback socket, which costs nothing next to a CKKS step); the SDK's ``Client`` in encrypted mode on the
real default model (SmolLM2-135M-Instruct); real SEAL keys. The workload is one where n-grams help: the
model is asked to copy a passage that is in its prompt.

Both modes run the same prompt on the same server, keys and plan, one after the other:

* ``base``: ``num_speculative_tokens = 0`` (one decode step per token and encrypted layer);
* ``spec``: ``--k`` drafts per step (one verify step of ``k + 1`` positions per encrypted layer, then a
  rollback message per layer when a draft was rejected).

Reported: TTFT, decode seconds per output token after the first (wall, as the user sees it: client,
server and worker together), the acceptance rate, tokens per verify step, and whether both
outputs equal greedy decoding with the plan simulated in plaintext (``fhe.simulator``).

The plan: one encrypted layer (the shipped plan's first), at ``--ring 16384`` by default (N = 16384, 2^30
scale, as the parity and e2e tests) or the shipped N = 32768 parameters (``--ring 32768``): one layer is
what this 2-core box can run in a benchmark's time.

``--offload-plan FILE`` (pack17): the server runs that offload plan as well (``[private] offload_plan``; its
``softmax = client`` layers as linear steps, a verify step of k + 1 positions packing their attention
steps); the one-layer attention plan then only gives the session's attention key (the plan file should
have no calibrated layer), and the outputs are checked against greedy decoding with that offload plan
simulated in plaintext (``fhe.offload_sim.OffloadSimulator``, no noise: client-aided non-linearities are the
model's own). ``--offload-plan default:2-3`` (issue 18 item 2) makes that file from the shipped offload plan
with only layers 2-3 on the server (attention as linear steps, client-aided MLP), the rest on the client.

Usage: PYTHONPATH=$PWD python bench/private_spec.py [--k 3] [--max-tokens 24] [--ring 16384]
    [--offload-plan FILE|default:A-B] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

KEY = "clm-bench-spec-enc-0000000000"
PASSAGE = ("The old lighthouse stood at the edge of the cliff for two hundred years, and every night "
           "its keeper climbed the steps to light the lamp.")
PROMPT = f"Text: {PASSAGE}\nThe same text, copied exactly:\nThe old"


def one_layer_plan(out: Path, ring: int) -> Path:
    from fhe.params import CKKSParams
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    full = Plan.load(default_plan_path())
    ckks = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30).to_dict() if ring == 16384 else full.ckks
    plan = Plan(full.model_id, full.weights_sha256, (full.layers[0],), ckks, "private_spec bench",
                full.calibration)
    return plan.save(out)


def cut_offload_plan(spec: str, out: Path) -> str:
    """``default:A-B`` -> the shipped offload plan with only layers A..B on the server, saved to ``out``; any
    other value is a plan file, returned as is."""
    from fhe.offload import LayerPlacement, OffloadPlan, default_offload_path

    if not spec.startswith("default:"):
        return spec
    lo, hi = (int(v) for v in spec.split(":", 1)[1].split("-"))
    full = OffloadPlan.load(default_offload_path())
    layers = tuple(p if lo <= p.index <= hi else LayerPlacement(p.index) for p in full.layers)
    return str(OffloadPlan(full.model_id, full.config, layers, full.attention_plan_hash, {}, full.created_by).save(out))


def offload_simulated_ids(offload_path: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with the offload plan simulated in plaintext (no noise)."""
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.offload import OffloadPlan
    from fhe.offload_sim import OffloadSimulator

    sim = OffloadSimulator(load_model(default_model_dir()), OffloadPlan.load(offload_path))
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            tok = int(sim.logits(ids)[-1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def make_app(plan: Path, state: Path, max_step: int, offload: str | None = None):
    from engine.default_model import default_model_dir
    from server.app import create_app
    from server.private.config import PrivateSettings
    from server.settings import Settings, TenantSettings
    from server.tenants import hash_api_key

    tenants = [TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEY)], privacy_mode="encrypted")]
    private = PrivateSettings(enabled=True, workers=1, plan=str(plan), max_session_tokens=128,
                              max_step_tokens=max_step, max_keys_per_worker=1, state_dir=str(state),
                              offload_plan=offload)
    settings = Settings(model=str(default_model_dir()), server_secret="bench", tenants=tenants,
                        private=private, engine={"device": "cpu", "num_kv_blocks": 16})
    return create_app(settings)


def generate(client, k: int, max_tokens: int) -> dict:
    """One streamed greedy completion: times, tokens, the SDK's step accounting and acceptance."""
    from client_sdk._private import runtime_of

    rt = runtime_of(client)
    t0 = time.perf_counter()
    stamps, texts = [], []
    for chunk in client.completions.create(prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
                                           extra_body={"num_speculative_tokens": k, "ignore_eos": True}):
        stamps.append(time.perf_counter())
        texts.append(chunk.choices[0].text)
    spec = rt.last_speculation
    n = len(stamps)
    row = {"k": k, "tokens": n, "text": "".join(texts), "ttft_s": round(stamps[0] - t0, 2),
           "decode_s": round(stamps[-1] - stamps[0], 2),
           "s_per_token_after_first": round((stamps[-1] - stamps[0]) / max(1, n - 1), 3)}
    if spec is not None:
        d = spec.decoder
        row.update(verify_steps=d.num_drafts, drafts=d.num_draft_tokens, accepted=d.num_accepted_tokens,
                   acceptance_rate=round(d.acceptance_rate, 3),
                   tokens_per_verify=round(1 + d.num_accepted_tokens / d.num_drafts, 2) if d.num_drafts else None)
    return row


def simulated_ids(plan_path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with the plan's approximation simulated in plaintext (fhe.simulator)."""
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.plan import Plan
    from fhe.simulator import simulated_greedy, simulated_model

    model = load_model(default_model_dir())
    plan = Plan.load(plan_path)
    return simulated_greedy(simulated_model(model, plan), plan, prompt_ids, max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ring", type=int, choices=(16384, 32768), default=16384)
    ap.add_argument("--offload-plan", help="also run this offload plan file (its linear steps)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from fastapi.testclient import TestClient

    from client_sdk import Client
    from client_sdk._private import runtime_of

    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="private-spec-"))
    plan = one_layer_plan(tmp / "plan.json", args.ring)
    if args.offload_plan:
        args.offload_plan = cut_offload_plan(args.offload_plan, tmp / "offload.json")
    app = make_app(plan, tmp / "state", max(16, args.k + 1), args.offload_plan)
    with TestClient(app, base_url="http://testserver") as http:
        client = Client(api_key=KEY, base_url="http://testserver", http_client=http, privacy="encrypted",
                        max_retries=0)
        rt = runtime_of(client)
        rt.cache_dir = tmp / "client"
        t0 = time.perf_counter()
        rt.prepare()
        setup_s = time.perf_counter() - t0
        rows = [generate(client, 0, args.max_tokens), generate(client, args.k, args.max_tokens)]
        prompt_ids = rt.tokenizer.encode(PROMPT)
        rt.close_session()
    sim = rt.tokenizer.decode(offload_simulated_ids(args.offload_plan, prompt_ids, args.max_tokens)
                              if args.offload_plan else simulated_ids(plan, prompt_ids, args.max_tokens))
    base, spec = rows
    report = {"model": "SmolLM2-135M-Instruct", "encrypted_layers": 1, "ring": args.ring, "k": args.k,
              "offload_plan": args.offload_plan,
              "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "setup_s": round(setup_s, 1),
              "base": base, "spec": spec,
              "speedup_s_per_token": round(base["s_per_token_after_first"] / spec["s_per_token_after_first"], 3),
              "identical_outputs": base["text"] == spec["text"], "simulator_text": sim,
              "base_equals_simulator": base["text"] == sim, "spec_equals_simulator": spec["text"] == sim,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
