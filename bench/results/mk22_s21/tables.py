"""The markdown tables of docs/benchmarks.md's "PDL and int4 prefetch" section from the call's JSON files.

    python bench/results/mk22_s21/tables.py bench/results/mk22_s21/call1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean


def _rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["engine"] if path.exists() else []


def step_table(d: Path) -> None:
    res = json.loads((d / "int4_pdl.json").read_text())
    print(f"copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, {res.get('gpu', '?')}\n")
    print("| shape | format | PDL | step (host clock), runs | mean | tokens/s | graph replay, runs | mean | "
          "floor | step share | replay share |")
    print("|---|---|---|---|---:|---:|---|---:|---:|---:|---:|")
    groups: dict[tuple, list[dict]] = {}
    for r in res["engine"]:
        groups.setdefault((r["shape"], r["format"], r["pdl"]), []).append(r)
    tok = {}
    for (shape, fmt, pdl), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {shape} | {fmt} | {'on' if pdl else 'off'} | error: {rs[0]['error'][:80]} ||||||||")
            continue
        step, rep = mean(r["step_ms"] for r in ok), mean(r["replay_ms"] for r in ok)
        floor = ok[0]["floor_ms_measured"]
        tok[(shape, fmt, bool(pdl))] = 1e3 / step
        steps = " / ".join(f"{r['step_ms']:.3f}" for r in ok)
        reps = " / ".join(f"{r['replay_ms']:.3f}" for r in ok)
        print(f"| {shape} | {fmt} | {'on' if pdl else 'off'} | {steps} | "
              f"{step:.3f} ms | {1e3 / step:,.0f} | {reps} | "
              f"{rep:.3f} ms | {floor:.3f} ms | {100 * floor / step:.1f} % | {100 * floor / rep:.1f} % |")
    print()
    for shape in dict.fromkeys(k[0] for k in tok):
        for pdl in (False, True):
            a, b = tok.get((shape, "int4", pdl)), tok.get((shape, "bf16", pdl))
            if a and b:
                print(f"* {shape}, PDL {'on' if pdl else 'off'}: int4 / bf16 tokens/s = {a / b:.2f}x")
    for shape in dict.fromkeys(k[0] for k in tok):
        for fmt in ("bf16", "int4"):
            a, b = tok.get((shape, fmt, False)), tok.get((shape, fmt, True))
            if a and b:
                print(f"* {shape} {fmt}: PDL on / off tokens/s = {b / a:.3f}x")


def gemv_table(d: Path) -> None:
    p = d / "gemv_pdl.json"
    if not p.exists():
        return
    res = json.loads(p.read_text())
    print(f"\ncopy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s\n")
    print("| shape | GEMM (N x K) | bf16 off | bf16 PDL | w32 default off | w32 default PDL | best w32 with PDL | "
          "which |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in res["gemm"]:
        def c(kind: str, tag: str, r: dict = r) -> str:
            us, tbs = r[f"{kind}_us_{tag}"], r[f"{kind}_tb_s_{tag}"]
            return f"{us:.2f} µs ({tbs:.2f} TB/s)"
        print(f"| {r['shape']} | {r['gemm']} {r['n']} x {r['k']} | {c('bf16', 'off')} | {c('bf16', 'on')} | "
              f"{c('w32', 'off')} | {c('w32', 'on')} | {r['w32_best_us_on']:.2f} µs "
              f"({r['w32_best_tb_s_on']:.2f} TB/s) | {r['w32_best_on']} |")
    eng = res["engine"]
    if eng:
        print("\nEngine rows in that process (PDL on, int4 with the best launches recorded):\n")
        print("| shape | format | step | tokens/s | replay | step share | replay share |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in eng:
            if "error" in r:
                print(f"| {r['shape']} | {r['format']} | error: {r['error'][:80]} |||||")
                continue
            print(f"| {r['shape']} | {r['format']} | {r['step_ms']:.3f} ms | {r['tok_per_s']:,.0f} | "
                  f"{r['replay_ms']:.3f} ms | {100 * r['share_measured']:.1f} % | "
                  f"{100 * r['replay_share_measured']:.1f} % |")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    step_table(out)
    gemv_table(out)
