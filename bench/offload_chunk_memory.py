"""Worker memory of one offload server layer with and without the chunk layout (``[private]
offload_chunk_layout``): the resident-set growth of building a SmolLM2 layer's linear blocks (attention as
linear steps + MLP), each variant in a fresh process so freed memory does not hide the next one's.

    python bench/offload_chunk_memory.py [--layer 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _build(layer: int, chunks: bool, out) -> None:
    import time

    import torch

    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.mlp import MLP_PARAMS, EncryptedMLP
    from fhe.offload_attention import EncryptedAttentionLinear

    torch.set_num_threads(1)
    model = load_model(default_model_dir())
    before, t0 = _rss_mb(), time.perf_counter()
    blocks = (EncryptedAttentionLinear(model.model.layers[layer], model.config, MLP_PARAMS, chunks=chunks),
              EncryptedMLP(model.model.layers[layer], MLP_PARAMS, chunks=chunks))
    out.put({"chunks": chunks, "rss_growth_mb": round(_rss_mb() - before, 1),
             "build_s": round(time.perf_counter() - t0, 2),
             "galois_steps": len(blocks[0].rotation_steps | blocks[1].rotation_steps)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for chunks in (False, True):
        q = ctx.Queue()
        p = ctx.Process(target=_build, args=(args.layer, chunks, q))
        p.start()
        rows.append(q.get())
        p.join()
    for r in rows:
        print(json.dumps(r))
    print(f"chunk layout adds {rows[1]['rss_growth_mb'] - rows[0]['rss_growth_mb']:.0f} MB per server layer "
          f"({rows[1]['rss_growth_mb'] / rows[0]['rss_growth_mb']:.1f}x the one-position blocks)")


if __name__ == "__main__":
    main()
