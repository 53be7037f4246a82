"""The offload plan's MLP steps on the GPU: SEAL vs our evaluator, one session at a time vs batched.

At :data:`fhe.mlp.MLP_PARAMS` (N = 8192, the shipped MLP parameters) on a SmolLM2-shaped random MLP layer
(hidden 576, intermediate 1536: speed does not depend on the values), per token (``mlp_up`` then
``mlp_down``, the client's exact SiLU in between done once outside the timing):

* SEAL on one CPU thread (the CPU worker today);
* the gpu backend, one session (CUDA graphs on): bit-identical to SEAL (checked here, every output);
* S sessions, each with its own key set: one after another (what a worker does today: the sessions-flat
  row) against one batched step (``fhe/backends/gpu/batched.py``: one launch per operation for all S,
  rows checked equal to the one-by-one results), aggregate tokens/s per layer;
* device bytes: the layer's encoded diagonals, one key set, one batch's working set per session.

    python3 bench/gpu_mlp.py --sessions 1,8,32 --out gpu_mlp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np
import torch


def _layer(seed: int = 0):
    from engine.config import ModelConfig
    from engine.model import DecoderLayer

    cfg = ModelConfig(97, 576, 1536, 4, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    torch.manual_seed(seed)
    layer = DecoderLayer(cfg, 2)
    with torch.no_grad():
        for p in layer.mlp.parameters():
            p.normal_(0.0, 0.02)
    return layer


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _token(ev, block, x, a, keys):
    """Both halves of one token (the client's SiLU between them is outside the server's time)."""
    return [ev.mod_switch(e(ev, x, keys), 1) for e in block._enc_up], ev.mod_switch(block._enc_down(ev, a, keys), 1)


def _sessions_row(ev, bev, block, sess: list, repeat: int) -> dict:
    """One session count: one after another vs one batched step, rows checked equal, device bytes."""
    from fhe.backends.gpu.batched import BatchKeys, run_linear
    from fhe.backends.seal import hazmat as seal

    n = len(sess)
    keys = [ev.keys_from_server(c.server_keys()) for c, _, _ in sess]
    xs = [ev.deserialize(seal.to_bytes(s[1])) for s in sess]
    acts = [ev.deserialize(seal.to_bytes(s[2])) for s in sess]

    def one_by_one():
        return [_token(ev, block, xi, ai, ki) for xi, ai, ki in zip(xs, acts, keys, strict=True)]

    def batched():
        bk = BatchKeys.of(keys)                                       # stacked per step: part of its cost
        up = [run_linear(bev, e, bev.stack(xs), bk) for e in block._enc_up]
        return up, run_linear(bev, block._enc_down, bev.stack(acts), bk)

    ref = one_by_one()
    cuda = ev.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    up, down = batched()
    _sync()
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    same = (all(ev.serialize(r[1]) == ev.serialize(c) for r, c in zip(ref, bev.unstack(down), strict=True))
            and all(ev.serialize(r[0][0]) == ev.serialize(c) for r, c in zip(ref, bev.unstack(up[0]), strict=True)))
    t_seq, t_bat = _median(one_by_one, repeat), _median(batched, repeat)
    return {"sessions": n, "one_by_one_s": t_seq, "batched_s": t_bat, "tok_s_layer_one_by_one": n / t_seq,
            "tok_s_layer_batched": n / t_bat, "batched_rows_equal": same,
            "batch_working_bytes_per_session": peak / n, "key_set_bytes_per_session": keys[0].nbytes()}


def main(argv: list[str] | None = None) -> int:
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.gpu.batched import BatchedEvaluator
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seal-repeat", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="'cpu': the torch-CPU reference (a smoke run, slow)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    layer = _layer()
    out: dict = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z",
                 "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
                 "params": MLP_PARAMS.to_dict()}
    cpu = EncryptedMLP(layer, MLP_PARAMS)
    ev = GpuEvaluator(MLP_PARAMS, args.device)
    mem = torch.cuda.memory_allocated if args.device == "cuda" else (lambda: 0)
    before = mem()
    t0 = time.perf_counter()
    block = EncryptedMLP(layer, MLP_PARAMS, evaluator=ev)
    out["encode_layer_s"] = time.perf_counter() - t0
    _sync()
    out["weights_bytes_per_layer"] = mem() - before
    steps = tuple(block.rotation_steps)
    rng = np.random.default_rng(0)

    def session():
        client = CKKSClient(MLP_PARAMS, steps)
        mlp = MLPClient(client, block.layout, 1e-5)
        x = mlp.encrypt_input(torch.from_numpy(rng.normal(size=576)))
        a = mlp.encrypt_activation(mlp.activation(cpu.gate_up(x, client.server_keys())))
        return client, x, a

    client, x, a = session()
    skeys = client.server_keys()
    before = mem()
    gkeys = ev.keys_from_server(skeys)
    out["key_set_bytes"] = mem() - before
    gx, ga = (ev.deserialize(seal.to_bytes(c)) for c in (x, a))
    # bit for bit: every output of both halves
    want_up, want_down = cpu.gate_up(x, skeys), cpu.down(a, skeys)
    got_up, got_down = _token(ev, block, gx, ga, gkeys)
    out["bit_identical_to_seal"] = ([ev.serialize(c) for c in [*got_up, got_down]]
                                    == [ev.serialize(ev.deserialize(seal.to_bytes(c))) for c in [*want_up, want_down]])
    out["seal_token_s"] = _median(lambda: (cpu.gate_up(x, skeys), cpu.down(a, skeys)), args.seal_repeat)
    _token(ev, block, gx, ga, gkeys)
    out["gpu_token_s"] = _median(lambda: _token(ev, block, gx, ga, gkeys), args.repeat)
    print(f"SEAL {out['seal_token_s'] * 1e3:.1f} ms/token/layer, gpu {out['gpu_token_s'] * 1e3:.2f} ms "
          f"(bit-identical: {out['bit_identical_to_seal']})", flush=True)
    bev = BatchedEvaluator(ev)
    rows = []
    for n in [int(s) for s in args.sessions.split(",")]:
        rows.append(_sessions_row(ev, bev, block, [session() for _ in range(n)], args.repeat))
        print(json.dumps(rows[-1]), flush=True)
    out["sessions"] = rows
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
