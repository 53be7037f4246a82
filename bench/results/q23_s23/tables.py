"""The q23 call's tables from its files: python bench/results/q23_s23/tables.py <dir with ab.json, layer.json>."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from bench.int4_gpu import summary  # noqa: E402


def layer_table(rows: list[dict]) -> str:
    out = ["| shape | format | launch | qkv | o | gate_up | down | layer (4 kernels) | unfused layer (8) | floor |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['format']} | error: {r['error'][:80]} |")
            continue
        u = r["unfused"]
        for name, f in r["fused"].items():
            out.append(f"| {r['shape']} | {r['format']} | {name} | {f['qkv']:.2f} | {f['o']:.2f} | {f['gate_up']:.2f} "
                       f"| {f['down']:.2f} | {f['layer']:.2f} | {u['layer']:.2f} | {r['floor_us']:.2f} |")
        out.append(f"| {r['shape']} | {r['format']} | unfused: norm {u['add_rms_norm']:.2f}, rope+store "
                   f"{u['rope_store']:.2f}, silu {u['silu_mul']:.2f} | {u['qkv']:.2f} | {u['o']:.2f} | "
                   f"{u['gate_up']:.2f} | {u['down']:.2f} | | {u['layer']:.2f} | |")
    return "\n".join(out)


def main() -> None:
    d = sys.argv[1]
    ab = os.path.join(d, "ab.json")
    if os.path.exists(ab):
        res = json.load(open(ab))
        print(f"{res['gpu']}, copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s\n")
        print(summary(res["engine"]))
        for r in res["engine"]:
            if "error" in r:
                print("error:", r["shape"], r["format"], r.get("fused_layers"), r["error"][:300])
    layer = os.path.join(d, "layer.json")
    if os.path.exists(layer):
        res = json.load(open(layer))
        print(f"\nper kernel, µs ({res['gpu']}, PDL {res['pdl']}):\n")
        print(layer_table(res["rows"]))


if __name__ == "__main__":
    main()
