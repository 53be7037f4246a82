"""The layer GEMMs of a shape at one row, timed in CUDA graphs: bf16 gemv vs int4 (byte layout) vs int4 w32.

Per GEMM (qkv, o, gate_up, down, head of the shape): a graph of ``LAUNCHES`` launches over ``COPIES``
weight copies in turn (more bytes than the 60 MB L2, so every launch reads its weight from HBM), replayed
``REPLAYS`` times; the median replay over ``LAUNCHES`` is one launch in a decode graph. Each w32 tuning is
checked against the torch reference on fresh random inputs (poisoned output) before it is timed. Then
the engine rows of ``bench/int4_gpu.py`` (batch-1 decode step, bf16 and int4, one run).

    python -m bench.gemv_int4_gpu --shapes llama3.2-1b --json $OUT/gemv_int4.json
    python -m bench.gemv_int4_gpu --pdl-ab --shapes llama3.2-1b,qwen2.5-0.5b   # default launches, PDL off/on
    python -m bench.gemv_int4_gpu --split-sweep --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/split.json

``--split-sweep`` (session 23): per GEMM the w32 default and the ``SPLIT_TUNINGS`` (split K, with and without the
register prefetch; the nibbles read in place, ``mantissa_unpack``), PDL on, each checked against the fp64
reference first; µs, TB/s and the share of the copy bandwidth measured in the same process, the best per GEMM, a
table and a ``BEST_W32`` literal of them; then the engine's batch-1 rows: bf16, int4 default, int4 with the best
launches, int4 default again
(``bench/int4_gpu.py --w32-tunings split.json`` applies the same best launches to its rows).

``--pdl-ab``: per GEMM the bf16 ``gemv`` and the int4 w32 default launch, each in its graph of ``LAUNCHES``
launches with plain launches and with programmatic dependent launch (``kernels.set_pdl``: the next launch
starts, and loads its weights, while this one finishes); then, with PDL on, the ``PREFETCH_TUNINGS`` (each
checked against the fp64 reference first), the best launch of each GEMM recorded (``set_tuning_int4_w32``)
for the engine rows that follow in the same process (bf16 and int4, PDL on; ``--no-engine``: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import kernels
from bench.engine_gpu import SHAPES, copy_bandwidth
from engine.fused import quantize_int4_rtn

LAUNCHES, REPLAYS = 64, 20
# run 1 (one K step of 2048 columns a program, no pipelining): best 0.7-1.8 TB/s; so: shorter K steps,
# more stages (the next step's words in flight while this one computes), fewer registers, more programs
TUNINGS = [kernels.GemvInt4W32Tuning(bn, g, w, st) for bn, g, w, st in (
    (4, 64, 4, 2), (8, 32, 4, 2), (16, 64, 4, 2), (4, 16, 4, 3), (8, 16, 4, 3), (8, 16, 4, 4), (16, 16, 4, 3),
    (16, 16, 4, 4), (16, 8, 4, 4), (32, 8, 4, 4), (32, 16, 8, 3), (16, 32, 4, 3), (8, 8, 2, 4), (4, 32, 2, 3))]
# run 2: every tuning within 10 % on gate_up (1.36 TB/s) -> a shared cost: the SASS shows x's [G, W] tile
# converted through shared memory (2 barriers) for each nibble; x_per_row loads x in the words' layout
TUNINGS += [kernels.GemvInt4W32Tuning(bn, g, w, st, x_per_row=True) for bn, g, w, st in (
    (4, 64, 4, 2), (8, 32, 4, 2), (16, 64, 4, 2), (4, 32, 2, 3), (16, 32, 4, 2), (32, 32, 8, 2),
    # session 8: deeper pipelines and shorter K steps once the barriers are gone (expect 2-3 TB/s on gate_up)
    (8, 16, 4, 3), (16, 16, 4, 3), (8, 16, 4, 4), (32, 16, 8, 3), (8, 64, 8, 2))]


# session 21: Triton does not pipeline the w32 loads (no async copies at any num_stages), so a program's loads
# and its unpack/FMA never overlap; prefetch=True double-buffers the next K step in registers. Several K
# steps per program (groups < 64 at K = 2048) so that there is a next step to load
PREFETCH_TUNINGS = [kernels.GemvInt4W32Tuning(bn, g, w, 2, prefetch=True) for bn, g, w in (
    (16, 16, 4), (8, 32, 4), (16, 32, 4), (8, 16, 4), (4, 16, 4), (32, 16, 8))]


# session 23: split K (GemvInt4W32Tuning.split_k: several programs per row block, the last sums the partials in
# the same launch) for more weight bytes in flight per SM, alone and with the register prefetch; split 1 rows at
# the same block_n / groups so each split's effect reads against its own unsplit launch
SPLIT_TUNINGS = [kernels.GemvInt4W32Tuning(bn, g, 4, 2, prefetch=pf, split_k=sk) for bn, g, sk, pf in (
    (4, 16, 1, False), (4, 16, 2, False), (4, 16, 4, False), (4, 8, 8, False), (8, 16, 1, False), (8, 16, 2, False),
    (8, 16, 4, False), (8, 32, 2, False), (16, 16, 1, False), (16, 16, 2, False), (16, 16, 4, False),
    (16, 32, 2, False), (4, 16, 4, True), (8, 16, 2, True), (8, 8, 4, True), (16, 16, 4, True))]
# and the nibbles read in place in the mantissa (fewer int instructions a weight: 1167 vs 1729 in the sm_90 SASS
# of 16 rows x 64 groups, compiled here), at the default launch and at split launches
SPLIT_TUNINGS += [kernels.GemvInt4W32Tuning(bn, g, 4, 2, split_k=sk, mantissa_unpack=True) for bn, g, sk in (
    (16, 64, 1), (4, 64, 1), (16, 16, 1), (16, 16, 2), (8, 16, 4), (4, 16, 4))]


def gemm_shapes(name: str) -> dict[str, tuple[int, int]]:
    c = SHAPES[name]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    return {"qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h), "o": (h, h),
            "gate_up": (2 * i, h), "down": (h, i), "head": (c["vocab_size"], h)}


def graph_us(fns: list, launches: int = LAUNCHES, replays: int = REPLAYS) -> float:
    """Median µs of one launch: a graph of ``launches`` calls cycling through `fns`, replayed ``replays`` times."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(launches):
            fns[j % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / launches)
    return sorted(ts)[len(ts) // 2]


def check(x, q32, so, tune) -> float:
    """Relative error of the kernel vs the fp64 reference on this x; NaN if an output was left unwritten."""
    out = torch.full((x.shape[0], q32.shape[0]), float("nan"), device="cuda", dtype=x.dtype)
    got = kernels.gemv_int4_w32(x, q32, so, out=out, tuning=tune, backend="triton").double()
    ref = x.double() @ kernels.dequantize_int4_w32(q32, so).double().T
    return float(((got - ref).norm() / ref.norm()).item())


def gemm_row(shape: str, part: str, n: int, k: int, copies: int) -> dict:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qs = [quantize_int4_rtn(w, 32) for w in ws]
    bytes_q = qs[0].nbytes()
    row = {"shape": shape, "gemm": part, "n": n, "k": k, "int4_bytes": bytes_q, "bf16_bytes": n * k * 2}
    row["bf16_us"] = graph_us([lambda w=w: kernels.gemv(x, w) for w in ws])
    errs, times = {}, {}
    for t in TUNINGS:
        fresh = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        errs[str(t)] = check(fresh, qs[0].qweight, qs[0].scale_offset, t)
        times[str(t)] = graph_us([lambda q=q, t=t: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset, tuning=t)
                                  for q in qs])
    kernels.set_tuning_int4_w32(n, k, 32, None)
    row["w32_default_us"] = graph_us([lambda q=q: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset) for q in qs])
    best = min(times, key=times.get)
    kernels.set_tuning_int4_w32(n, k, 32, next(t for t in TUNINGS if str(t) == best))  # the engine rows use it
    row.update(w32_best_us=times[best], w32_best=best, w32_max_rel_err=max(errs.values()), w32_times=times)
    row["bf16_tb_s"] = row["bf16_bytes"] / row["bf16_us"] / 1e6
    row["w32_best_tb_s"] = bytes_q / row["w32_best_us"] / 1e6
    row["w32_default_tb_s"] = bytes_q / row["w32_default_us"] / 1e6
    return row


def pdl_ab_row(shape: str, part: str, n: int, k: int, copies: int) -> dict:
    """bf16 gemv and int4 w32 (default launch) in graphs of LAUNCHES launches, PDL off then on."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qs = [quantize_int4_rtn(w, 32) for w in ws]
    row = {"shape": shape, "gemm": part, "n": n, "k": k, "int4_bytes": qs[0].nbytes(), "bf16_bytes": n * k * 2}
    for pdl in (False, True):
        kernels.set_pdl(pdl)  # read at launch: the graphs below capture launches with / without it
        tag = "on" if pdl else "off"
        row[f"bf16_us_{tag}"] = graph_us([lambda w=w: kernels.gemv(x, w) for w in ws])
        row[f"w32_us_{tag}"] = graph_us([lambda q=q: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset)
                                         for q in qs])
        row[f"bf16_tb_s_{tag}"] = row["bf16_bytes"] / row[f"bf16_us_{tag}"] / 1e6
        row[f"w32_tb_s_{tag}"] = row["int4_bytes"] / row[f"w32_us_{tag}"] / 1e6
    times, errs = {"default": row["w32_us_on"]}, {}
    for t in PREFETCH_TUNINGS:  # PDL still on
        errs[str(t)] = check(torch.randn(1, k, device="cuda", dtype=torch.bfloat16), qs[0].qweight,
                             qs[0].scale_offset, t)
        if not errs[str(t)] < 1e-2:  # a wrong launch is recorded, never timed or chosen
            continue
        times[str(t)] = graph_us([lambda q=q, t=t: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset, tuning=t)
                                  for q in qs])
    kernels.set_pdl(False)
    best = min(times, key=times.get)
    kernels.set_tuning_int4_w32(n, k, 32, next((t for t in PREFETCH_TUNINGS if str(t) == best), None))
    row.update(w32_prefetch_us=times, w32_prefetch_err=errs, w32_best_on=best, w32_best_us_on=times[best],
               w32_best_tb_s_on=row["int4_bytes"] / times[best] / 1e6)
    return row


def split_sweep_row(shape: str, part: str, n: int, k: int, copies: int, bw: float) -> dict:
    """The w32 default and every SPLIT_TUNINGS launch (each checked against the fp64 reference first) in graphs of
    LAUNCHES launches, PDL on (the engine's default): µs, TB/s and share of the copy bandwidth; the best launch
    (the default unless a variant beats it) is recorded for this process's engine rows."""
    kernels.set_pdl(True)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qs = [quantize_int4_rtn(w, 32) for w in ws]
    del ws
    nbytes = qs[0].nbytes()
    kernels.set_tuning_int4_w32(n, k, 32, None)
    times = {"default": graph_us([lambda q=q: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset) for q in qs])}
    errs = {}
    for t in SPLIT_TUNINGS:
        try:
            errs[str(t)] = check(torch.randn(1, k, device="cuda", dtype=torch.bfloat16), qs[0].qweight,
                                 qs[0].scale_offset, t)
        except Exception as exc:  # noqa: BLE001 - recorded; the other launches still run
            errs[str(t)] = repr(exc)
            continue
        if not errs[str(t)] < 1e-2:  # a wrong launch is recorded, never timed or chosen
            continue
        try:
            times[str(t)] = graph_us([lambda q=q, t=t: kernels.gemv_int4_w32(x, q.qweight, q.scale_offset,
                                                                             tuning=t) for q in qs])
        except Exception as exc:  # noqa: BLE001 - e.g. a capture that fails: recorded, not chosen
            errs[str(t)] = repr(exc)
    kernels.set_pdl(False)
    best = min(times, key=times.get)
    best_tune = next((t for t in SPLIT_TUNINGS if str(t) == best), None)
    kernels.set_tuning_int4_w32(n, k, 32, best_tune)
    tb = {key: nbytes / us / 1e6 for key, us in times.items()}
    return {"shape": shape, "gemm": part, "n": n, "k": k, "int4_bytes": nbytes, "us": times, "tb_s": tb,
            "share_of_copy_bw": {key: v * 1e12 / bw for key, v in tb.items()}, "err": errs, "best": best,
            "best_tuning": None if best_tune is None else dataclasses.asdict(best_tune),
            "best_us": times[best], "best_tb_s": tb[best], "default_us": times["default"]}


def print_split_row(row: dict) -> None:
    """One line per launch of a sweep row, then its best."""
    print(f"{row['shape']} {row['gemm']} {row['n']}x{row['k']} ({row['int4_bytes'] / 1e6:.1f} MB):", flush=True)
    for key, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
        print(f"    {us:7.2f} us {row['tb_s'][key]:5.2f} TB/s {100 * row['share_of_copy_bw'][key]:5.1f} % of copy bw  "
              f"{key}", flush=True)
    bad = {key: e for key, e in row["err"].items() if not (isinstance(e, float) and e < 1e-2)}
    if bad:
        print(f"    not timed (wrong or failed): {bad}", flush=True)
    print(f"  BEST {row['shape']} {row['gemm']}: {row['best_us']:.2f} us ({row['best_tb_s']:.2f} TB/s, "
          f"{row['default_us'] / row['best_us']:.2f}x the default) {row['best']}", flush=True)


def split_summary(rows: list[dict]) -> str:
    """The best launch per GEMM as a table, and as the literal a default change would start from."""
    out = ["| shape | GEMM (N x K) | default | best | speed-up | best TB/s (share of copy bw) | best launch |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['gemm']} {r['n']} x {r['k']} | {r['default_us']:.2f} µs "
                   f"| {r['best_us']:.2f} µs | {r['default_us'] / r['best_us']:.2f}x | {r['best_tb_s']:.2f} "
                   f"({100 * r['share_of_copy_bw'][r['best']]:.0f} %) | {r['best']} |")
    best = {(r["n"], r["k"], 32): r["best_tuning"] for r in rows if r["best_tuning"] is not None}
    out.append(f"BEST_W32 = {best!r}")
    return "\n".join(out)


def byte_layout_us(n: int, k: int, copies: int) -> float:
    """The previous kernel (kernels.gemv_int4, byte layout, its default tuning) on the same shape."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qs = []
    for _ in range(copies):
        u = torch.randint(0, 16, (n, k), device="cuda")
        s = torch.rand(n, k // 32, device="cuda").half() * 1e-3
        qs.append((kernels.pack_int4_rows(u), s, s.clone()))
    return graph_us([lambda q=q: kernels.gemv_int4(x, *q) for q in qs])


def save(path: str | None, res: dict) -> None:
    """Write the results so far (a run cut short keeps what it measured)."""
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b")
    ap.add_argument("--no-engine", action="store_true", help="only the GEMMs")
    ap.add_argument("--json")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="default launches with PDL off / on, prefetch launches with PDL on (no full sweep)")
    ap.add_argument("--split-sweep", action="store_true",
                    help="the w32 default vs the split-K / prefetch launches (PDL on), best per GEMM; then engine "
                         "rows bf16, int4 default, int4 best, int4 default")
    args = ap.parse_args()
    if args.split_sweep:
        split_main(args)
        return
    bw = copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "gemm": [], "engine": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name in args.shapes.split(","):
        for part, (n, k) in gemm_shapes(name).items():
            copies = max(2, min(LAUNCHES, int(160e6 // (n * k * 0.625)) + 1))  # int4 copies > 60 MB L2
            if args.pdl_ab:
                row = pdl_ab_row(name, part, n, k, copies)
                res["gemm"].append(row)
                save(args.json, res)
                print(f"{name} {part:>7} {n}x{k}: " + ", ".join(
                    f"{kind} {row[f'{kind}_us_{t}']:.2f} us ({row[f'{kind}_tb_s_{t}']:.2f} TB/s) pdl {t}"
                    for kind in ("bf16", "w32") for t in ("off", "on"))
                    + f"; best w32 with pdl {row['w32_best_us_on']:.2f} us ({row['w32_best_tb_s_on']:.2f} TB/s) "
                    f"{row['w32_best_on']}", flush=True)
                del row
                torch.cuda.empty_cache()
                continue
            row = gemm_row(name, part, n, k, copies)
            row["byte_layout_us"] = byte_layout_us(n, k, copies)
            res["gemm"].append(row)
            print(f"{name} {part:>7} {n}x{k}: bf16 {row['bf16_us']:.1f} us ({row['bf16_tb_s']:.2f} TB/s), int4 byte "
                  f"{row['byte_layout_us']:.1f} us, w32 default {row['w32_default_us']:.1f} us "
                  f"({row['w32_default_tb_s']:.2f} TB/s), best {row['w32_best_us']:.1f} us {row['w32_best']} "
                  f"({row['w32_best_tb_s']:.2f} TB/s), max rel err {row['w32_max_rel_err']:.1e}", flush=True)
            torch.cuda.empty_cache()
        if args.pdl_ab and not args.no_engine:  # the recorded launches, PDL on, in this process
            from bench.int4_gpu import engine_row

            for fmt in ("bf16", "int4"):
                try:
                    row = engine_row(name, fmt, bw, pdl=True)
                except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
                    row = {"shape": name, "format": fmt, "pdl": True, "error": repr(exc)}
                row["tunings"] = "gemv_int4_gpu --pdl-ab best" if fmt == "int4" else "-"
                res["engine"].append(row)
                save(args.json, res)
                print(json.dumps(row), flush=True)
            for n, k in gemm_shapes(name).values():
                kernels.set_tuning_int4_w32(n, k, 32, None)
        elif not (args.no_engine or args.pdl_ab):
            from bench.int4_gpu import engine_row

            for fmt in ("bf16", "int4"):
                row = engine_row(name, fmt, bw)
                res["engine"].append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


def split_main(args) -> None:
    """--split-sweep: per shape, every GEMM's sweep, then the engine rows A/B/A (int4 default, best, default)."""
    bw = copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "gemm": [], "engine": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name in args.shapes.split(","):
        rows = []
        for part, (n, k) in gemm_shapes(name).items():
            copies = max(2, min(LAUNCHES, int(160e6 // (n * k * 0.625)) + 1))  # int4 copies > 60 MB L2
            rows.append(split_sweep_row(name, part, n, k, copies, bw))
            print_split_row(rows[-1])
            res["gemm"].append(rows[-1])
            save(args.json, res)
            torch.cuda.empty_cache()
        print(split_summary(rows), flush=True)
        if not args.no_engine:
            engine_ab(name, bw, rows, res, args.json)
    save(args.json, res)


def engine_ab(name: str, bw: float, rows: list[dict], res: dict, path: str | None) -> None:
    """bf16, then int4 with the default launches, the sweep's best, the default again (PDL: the engine's)."""
    from bench.int4_gpu import engine_row

    best = {(r["n"], r["k"]): r["best_tuning"] for r in rows}
    for fmt, tunings in (("bf16", "-"), ("int4", "default"), ("int4", "best"), ("int4", "default")):
        for (n, k), t in best.items():
            use = t is not None and tunings == "best"
            kernels.set_tuning_int4_w32(n, k, 32, kernels.GemvInt4W32Tuning(**t) if use else None)
        try:
            row = engine_row(name, fmt, bw)
        except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
            row = {"shape": name, "format": fmt, "error": repr(exc)}
        row["tunings"] = tunings
        res["engine"].append(row)
        save(path, res)
        print(json.dumps(row), flush=True)
    for n, k in best:
        kernels.set_tuning_int4_w32(n, k, 32, None)


if __name__ == "__main__":
    main()
