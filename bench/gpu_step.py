# ruff: noqa: B023 - every lambda here is timed at once, inside its loop iteration
"""One offload step inside the GPU worker, phase by phase; the old path and the whole-step graphs side by side.

At :data:`fhe.mlp.MLP_PARAMS` (N = 8192) on a SmolLM2-shaped random MLP layer (hidden 576, intermediate
1536; speed does not depend on the values), the steps ``mlp_up`` and ``mlp_down``:

* **phases** of the worker's path (``server/private/compute.py`` ``_OffloadLinear.run``): SEAL ciphertext ->
  SEAL bytes (``seal.to_bytes``) -> parse (``sealio``) -> H2D -> the step -> D2H -> serialize (zstd) ->
  SEAL loads it back; each timed alone (median, synchronised);
* **compute** of one step three ways, each checked residue for residue: ``old`` (the one-session
  evaluator, a graph per rotation/rescale, staged NTT: what the worker ran), ``graphs`` (the whole step one
  CUDA graph, :mod:`fhe.backends.gpu.step`, staged NTT), ``graphs+fused`` (the same with the one-launch
  NTT, ``triton_ops.FUSED``); kernels per step and their summed device time from torch's profiler;
* **batches** of 1/8/32 ciphertexts of one step: one key set (a step's positions) and one key set per row
  (sessions): one after another on the old path vs one graph replay; tokens/s/layer (both halves).

SEAL (one CPU thread) is run for the first rows to check every path bit for bit against it.

    python3 bench/gpu_step.py --batches 1,8,32 --out gpu_step.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import numpy as np
import torch

from bench.gpu_mlp import _median, _sync


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _kernels(fn) -> dict:
    """Kernels launched by ``fn()`` and their summed device time (torch's profiler; {} if unavailable)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync()
        evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and "cuda" in str(e.device_type).lower()]
        total = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in evs)
        return {"kernels": len(evs), "device_time_ms": total / 1e3}
    except Exception as exc:  # noqa: BLE001 - the profile is extra information
        return {"error": repr(exc)}


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_mlp import _layer
    from fhe import sealio
    from fhe.backends.gpu import GpuEvaluator, triton_ops
    from fhe.backends.gpu.batched import BatchKeys
    from fhe.backends.gpu.step import StepGraphs
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seal-rows", type=int, default=2, help="rows checked against SEAL itself")
    ap.add_argument("--sweep", default="", help="local NTT configs 'LOCALxWARPS,...' (e.g. 1024x4,2048x8)")
    ap.add_argument("--device", default="cuda", help="'cpu': the torch-CPU reference (a smoke run, slow)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z",
                 "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
                 "params": MLP_PARAMS.to_dict(), "uptime": _uptime()}
    layer = _layer()
    cpu = EncryptedMLP(layer, MLP_PARAMS)
    ev = GpuEvaluator(MLP_PARAMS, args.device)
    cuda = args.device == "cuda"
    mem = torch.cuda.memory_allocated if cuda else (lambda: 0)
    block = EncryptedMLP(layer, MLP_PARAMS, evaluator=ev)
    steps = tuple(block.rotation_steps)
    rng = np.random.default_rng(0)

    def up(e, x, k):
        return [e.mod_switch(m(e, x, k), 1) for m in block._enc_up]

    def down(e, x, k):
        return e.mod_switch(block._enc_down(e, x, k), 1)

    fns = {"mlp_up": up, "mlp_down": down}
    seal_fns = {"mlp_up": lambda c, k: cpu.gate_up(c, k), "mlp_down": lambda c, k: [cpu.down(c, k)]}

    def session():
        client = CKKSClient(MLP_PARAMS, steps)
        mlp = MLPClient(client, block.layout, 1e-5)
        x = mlp.encrypt_input(torch.from_numpy(rng.normal(size=576)))
        a = mlp.encrypt_activation(mlp.activation(cpu.gate_up(x, client.server_keys())))
        return client, {"mlp_up": x, "mlp_down": a}

    def ser(cs):
        return [ev.serialize(c) for c in (cs if isinstance(cs, list) else [cs])]

    staged = StepGraphs(ev)
    fused = StepGraphs(ev)

    def old_step(name, x, k):
        triton_ops.FUSED = False
        try:
            r = fns[name](ev, x, k)
        finally:
            triton_ops.FUSED = True
        return r if isinstance(r, list) else [r]

    def graph_step(sg, name, xs, k, fuse):
        triton_ops.FUSED = fuse
        try:
            return sg.run(name, fns[name], xs, k)
        finally:
            triton_ops.FUSED = True

    # --- one session: phases and compute ----------------------------------------------------------------
    client, cts = session()
    skeys = client.server_keys()
    kit = client.kit
    mem0 = mem()
    gkeys = ev.keys_from_server(skeys)
    out["key_set_bytes"] = mem() - mem0
    one: dict = {}
    for name, sct in cts.items():
        want = [ev.serialize(ev.deserialize(seal.to_bytes(c))) for c in seal_fns[name](sct, skeys)]
        blob = seal.to_bytes(sct)
        gx = ev.deserialize(blob)
        raw = sealio.read_ciphertext(blob, MLP_PARAMS.poly_modulus_degree, ev.top)
        host = torch.from_numpy(raw.data.astype(np.int64))
        res_old = old_step(name, gx, gkeys)
        res_staged = graph_step(staged, name, [gx], gkeys, False)[0]
        res_fused = graph_step(fused, name, [gx], gkeys, True)[0]
        row = {"bit_identical_to_seal": {"old": ser(res_old) == want, "graphs": ser(res_staged) == want,
                                          "graphs+fused": ser(res_fused) == want}}
        res_bytes = ev.serialize(res_fused[0])
        phases = {
            "seal_to_bytes": _median(lambda: seal.to_bytes(sct), args.repeat),
            "parse_sealio": _median(lambda: sealio.read_ciphertext(blob, MLP_PARAMS.poly_modulus_degree, ev.top),
                                    args.repeat),
            "h2d": _median(lambda: host.to(args.device), args.repeat),
            "deserialize_total": _median(lambda: ev.deserialize(blob), args.repeat),
            "compute_old": _median(lambda: old_step(name, gx, gkeys), args.repeat),
            "compute_graphs": _median(lambda: graph_step(staged, name, [gx], gkeys, False), args.repeat),
            "compute_graphs_fused": _median(lambda: graph_step(fused, name, [gx], gkeys, True), args.repeat),
            "d2h": _median(lambda: [c.data.cpu() for c in res_fused], args.repeat),
            "serialize_zstd": _median(lambda: [ev.serialize(c) for c in res_fused], args.repeat),
            "serialize_raw": _median(lambda: [ev.serialize(c, compress=False) for c in res_fused], args.repeat),
            "seal_from_bytes_zstd": _median(lambda: seal.from_bytes("ciphertext", kit, res_bytes), args.repeat),
            "seal_from_bytes_raw": _median(
                lambda: seal.from_bytes("ciphertext", kit, ev.serialize(res_fused[0], compress=False)), args.repeat),
        }
        row["phases_ms"] = {k: v * 1e3 for k, v in phases.items()}
        row["kernels"] = {"old": _kernels(lambda: old_step(name, gx, gkeys)),
                          "graphs": _kernels(lambda: graph_step(staged, name, [gx], gkeys, False)),
                          "graphs+fused": _kernels(lambda: graph_step(fused, name, [gx], gkeys, True))}
        one[name] = row
        print(name, json.dumps(row), flush=True)
    out["one_step"] = one
    out["capture_s_one_step_both"] = fused.capture_s

    # --- the local NTT kernel's block size and warps (each config: fresh graphs, checked against SEAL) -----
    if args.sweep:
        xs1 = {n: [ev.deserialize(seal.to_bytes(c))] for n, c in cts.items()}
        wants = {n: ser(old_step(n, xs1[n][0], gkeys)) for n in fns}
        default = (triton_ops.LOCAL, triton_ops.LOCAL_WARPS)
        sweep = []
        for cfg in args.sweep.split(","):
            local, warps = (int(v) for v in cfg.split("x"))
            triton_ops.LOCAL, triton_ops.LOCAL_WARPS = local, warps
            sg = StepGraphs(ev)
            try:
                same = all(ser(graph_step(sg, n, xs1[n], gkeys, True)[0]) == wants[n] for n in fns)
                t1 = sum(_median(lambda: graph_step(sg, n, xs1[n], gkeys, True), args.repeat) for n in fns)
                x32 = {n: xs1[n] * 32 for n in fns}
                same = same and all(ser(graph_step(sg, n, x32[n], gkeys, True)[5]) == wants[n] for n in fns)
                t32 = sum(_median(lambda: graph_step(sg, n, x32[n], gkeys, True), args.repeat) for n in fns)
                sweep.append({"local": local, "warps": warps, "token_ms_b1": t1 * 1e3, "token_ms_b32": t32 * 1e3,
                              "equal_to_old": same})
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                sweep.append({"local": local, "warps": warps, "error": repr(exc)[:300]})
            print(json.dumps(sweep[-1]), flush=True)
        triton_ops.LOCAL, triton_ops.LOCAL_WARPS = default
        out["local_ntt_sweep"] = sweep

    # --- batches: one key set (positions) and one per row (sessions) ------------------------------------
    sess = [(client, cts)]
    rows = []
    for b in [int(s) for s in args.batches.split(",")]:
        while len(sess) < b:
            sess.append(session())
        keys = [gkeys] + [ev.keys_from_server(c.server_keys()) for c, _ in sess[1:b]]
        row: dict = {"batch": b}
        for name in fns:
            xs = [ev.deserialize(seal.to_bytes(s[1][name])) for s in sess[:b]]
            ref_shared = [ser(old_step(name, x, gkeys)) for x in xs]
            ref_rows = [ser(old_step(name, x, k)) for x, k in zip(xs, keys, strict=True)]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = mem()
            got_shared = [ser(r) for r in graph_step(fused, name, xs, gkeys, True)]
            got_rows = [ser(r) for r in graph_step(fused, name, xs, keys, True)]
            _sync()
            peak = torch.cuda.max_memory_allocated() - base if cuda else 0
            seal_ok = all(ser(old_step(name, xs[i], keys[i])) ==
                          [ev.serialize(ev.deserialize(seal.to_bytes(c)))
                           for c in seal_fns[name](sess[i][1][name], sess[i][0].server_keys())]
                          for i in range(min(args.seal_rows, b)))
            t = {"old_one_by_one_shared": _median(lambda: [old_step(name, x, gkeys) for x in xs], args.repeat),
                 "old_one_by_one_rows": _median(
                     lambda: [old_step(name, x, k) for x, k in zip(xs, keys, strict=True)], args.repeat),
                 "eager_batched_rows": _median(
                     lambda: fns[name](fused.bev, fused.bev.stack(xs), BatchKeys.of(keys)), max(2, args.repeat // 3)),
                 "graph_shared": _median(lambda: graph_step(fused, name, xs, gkeys, True), args.repeat),
                 "graph_rows": _median(lambda: graph_step(fused, name, xs, keys, True), args.repeat)}
            row[name] = {"ms": {k: v * 1e3 for k, v in t.items()},
                         "equal_to_one_session": {"shared": got_shared == ref_shared, "rows": got_rows == ref_rows},
                         "rows_checked_against_seal": seal_ok, "replay_working_bytes": peak}
        both = {k: row["mlp_up"]["ms"][k] + row["mlp_down"]["ms"][k] for k in row["mlp_up"]["ms"]}
        row["tok_s_layer"] = {k: b / (v / 1e3) for k, v in both.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["batches"] = rows
    out["graphs_captured"] = {"staged": len(staged), "fused": len(fused)}
    out["capture_s_total_fused"] = fused.capture_s
    out["device_bytes_allocated"] = mem()
    out["device_bytes_reserved"] = torch.cuda.memory_reserved() if cuda else 0
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
