"""The persistent decode kernel (kernels.decode_persistent) against the engine's per-op layer path, on the GPU.

Per shape (``bench/engine_gpu.py`` SHAPES, random bf16 weights, every layer, context 256 in a block table as wide
as the engine's at ``max_model_len`` 4096), µs per batch-1 step of the decoder layers (no embedding, no head),
each step one CUDA graph (``h`` reset from a copy first, the same in every graph), median of 60 replays:

* ``persistent``: one ``decode_persistent`` launch (no PDL: it is one launch);
* ``per_op``: the engine's path without the switch (``engine.fused.FusedLlama._layer`` with the GEMV rows):
  RMSNorm / add+RMSNorm, QKV GEMV (+ bias), RoPE + K/V store, paged attention (partition + merge), O GEMV,
  add+RMSNorm, gate/up GEMV, SiLU·mul, down GEMV, the final add — PDL as the engine sets it (on by default);
* ``decode_layer``: ``EngineConfig.cuda_fused_decode_layers`` (four launches + attention a layer), PDL likewise;

interleaved A/B/C/C/B/A over 2 rounds, plus the floor (the layers' weight bytes at ``copy_bandwidth()``) and a
sweep of the persistent launch (the L2 prefetch off or doubled, 8192-weight tiles, the register prefetch off,
programs P = SMs / 2, and 2 x SMs with 4 warps when two fit an SM), each timed once after the A/B rounds, on the
``--sweep-shapes`` (Qwen2.5-0.5B by default).
Every launch is first checked against the torch reference (relative error of h after all layers); a launch
whose programs were not all resident gives up at its first barrier (bounded polls, the error flag) and is
reported, not timed. Then one launch with ``%clock64`` stamps (``decode_persistent(trace=...)``): per layer, the
mean and max over programs of each stage and each barrier wait, in cycles and µs at the SM clock nvidia-smi reads.

    python -m bench.decode_persistent_gpu --shapes qwen2.5-0.5b,llama3.2-1b --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess

import torch

import kernels
from bench.engine_gpu import SHAPES, copy_bandwidth, cuda_median_ms
from kernels import DecodeLayerWeights, PersistentDecodeLayers, PersistentDecodeTuning

CONTEXT = 256
BS = 16
TABLE_BLOCKS = 4096 // BS  # the engine's decode-graph table width at max_model_len 4096
REPLAYS = 60


class Model:
    """Random bf16 decoder layers in a real shape, their pools, a batch-1 step's inputs."""

    def __init__(self, shape: dict, dev: str = "cuda") -> None:
        torch.manual_seed(0)
        bf = torch.bfloat16
        d, hq, hkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
        hid, inter, nl = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        self.hq, self.hkv, self.d, self.eps = hq, hkv, d, shape["rms_norm_eps"]

        def w(n, k):
            return torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5

        def gain():
            return 1.0 + 0.1 * torch.randn(hid, device=dev, dtype=bf)
        n_qkv = (hq + 2 * hkv) * d
        self.layers = [DecodeLayerWeights(gain(), w(n_qkv, hid),
                                          0.1 * torch.randn(n_qkv, device=dev, dtype=bf)
                                          if shape.get("attention_bias") else None,
                                          w(hid, hq * d), gain(), w(2 * inter, hid), w(hid, inter))
                       for _ in range(nl)]
        nblk = CONTEXT // BS + 1
        self.kc = [torch.randn(nblk, BS, hkv, d, device=dev, dtype=bf) for _ in range(nl)]
        self.vc = [torch.randn(nblk, BS, hkv, d, device=dev, dtype=bf) for _ in range(nl)]
        table = torch.zeros(1, TABLE_BLOCKS, dtype=torch.int32)
        table[0, :nblk] = torch.randperm(nblk, dtype=torch.int32)
        self.table = table.to(dev)
        self.lens = torch.tensor([CONTEXT], dtype=torch.int32, device=dev)
        pos = CONTEXT - 1
        self.slots = torch.tensor([int(table[0, pos // BS]) * BS + pos % BS], device=dev)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
        emb = torch.cat([pos * inv, pos * inv])[None]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.h0 = torch.randn(1, hid, device=dev, dtype=bf)
        self.h = self.h0.clone()
        self.scale = 1.0 / math.sqrt(d)
        self.plan = PersistentDecodeLayers.build(self.layers, self.kc, self.vc, hq, hkv, self.eps)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers for t in (w.qkv, w.o, w.gate_up, w.down))

    def persistent(self, tune: PersistentDecodeTuning | None = None) -> torch.Tensor:
        self.h.copy_(self.h0)
        return kernels.decode_persistent(self.h, self.cos, self.sin, self.slots, self.table, self.lens, self.plan,
                                         tuning=tune)

    def per_op(self) -> torch.Tensor:
        """engine.fused.FusedLlama._layer on GEMV rows, every layer, then h + residual."""
        self.h.copy_(self.h0)
        h, residual = self.h, None
        for w, kc, vc in zip(self.layers, self.kc, self.vc, strict=True):
            if residual is None:
                x, residual = kernels.rms_norm(h, w.input_norm, self.eps), h
            else:
                x, residual = kernels.add_rms_norm(h, residual, w.input_norm, self.eps)
            qkv = kernels.gemv(x, w.qkv, w.qkv_bias)
            q = kernels.rope_store_kv(qkv, self.hq, self.hkv, self.cos, self.sin, kc, vc, self.slots)
            o = kernels.paged_decode_attention(q, kc, vc, self.table, self.lens, self.scale)
            h = kernels.gemv(o.reshape(1, -1), w.o)
            x, residual = kernels.add_rms_norm(h, residual, w.post_norm, self.eps)
            h = kernels.gemv(kernels.silu_mul(kernels.gemv(x, w.gate_up)), w.down)
        return h + residual

    def decode_layer(self) -> torch.Tensor:
        """engine.fused.FusedLlama._forward_fused_layers: four launches + the attention a layer."""
        self.h.copy_(self.h0)
        h = self.h
        for w, kc, vc in zip(self.layers, self.kc, self.vc, strict=True):
            q = kernels.norm_qkv_rope_store(h, w.input_norm, self.eps, w.qkv, w.qkv_bias, self.hq, self.hkv,
                                            self.cos, self.sin, kc, vc, self.slots)
            o = kernels.paged_decode_attention(q, kc, vc, self.table, self.lens, self.scale)
            kernels.gemv_add_residual(o.reshape(1, -1), w.o, h)
            act = kernels.norm_gate_up_silu(h, w.post_norm, self.eps, w.gate_up)
            kernels.gemv_add_residual(act, w.down, h)
        return h

    def reference(self) -> torch.Tensor:
        h = self.h0.clone()
        return kernels.decode_persistent_reference(h, self.cos, self.sin, self.slots, self.table, self.lens,
                                                   self.plan)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` (already run once eagerly: compiled, workspaces made) in a CUDA graph, replayed once."""
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def checked(m: Model, name: str, fn, want: torch.Tensor, row: dict) -> torch.cuda.CUDAGraph | None:
    """Run ``fn`` eagerly, record its error against the reference (and a barrier give-up), capture it."""
    m.plan.clear_error()
    try:
        out = fn().clone()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded; the other launches still run
        row.setdefault("errors", {})[name] = repr(exc)[:2000]
        return None
    failed = m.plan.failed()
    row["rel_err"][name] = rel(out, want)
    if failed:
        row["not_resident"].append(name)
        m.plan.clear_error()
        return None
    return capture(fn)


def sweep(m: Model, sms: int) -> dict[str, PersistentDecodeTuning]:
    return {f"P={sms} no L2 prefetch": PersistentDecodeTuning(l2_prefetch_kb=0),
            f"P={sms} tile 8192": PersistentDecodeTuning(tile_elems=8192),
            f"P={sms} L2 prefetch 192 KB": PersistentDecodeTuning(l2_prefetch_kb=192),
            f"P={sms} no register prefetch": PersistentDecodeTuning(prefetch=False),
            f"P={sms // 2}": PersistentDecodeTuning(programs=sms // 2),
            f"P={2 * sms} 4 warps": PersistentDecodeTuning(programs=2 * sms, num_warps=4)}


PHASES = ["S1 norm+qkv+rope+store", "B0", "S2 attention", "B1", "S3 merge+o+residual", "B2",
          "S4 norm+gate/up+silu", "B3", "S5 down+residual", "B4"]


def sm_clock_mhz() -> float | None:
    """The SM clock now (nvidia-smi), to turn %clock64 cycles into µs."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def traced(m: Model, sms: int) -> dict:
    """One default launch with ``%clock64`` stamps: per phase (5 stages and 5 barrier waits a layer) the mean
    and the max over programs, averaged over layers 1.. (layer 0 starts cold), in cycles and µs."""
    nl = len(m.layers)
    tr = torch.zeros(nl * 11 * sms, dtype=torch.int64, device="cuda")
    for _ in range(2):  # the first compiles the traced variant
        m.h.copy_(m.h0)
        kernels.decode_persistent(m.h, m.cos, m.sin, m.slots, m.table, m.lens, m.plan, trace=tr)
    torch.cuda.synchronize()
    mhz = sm_clock_mhz()
    t = tr.view(nl, 11, sms).double()
    d = (t[:, 1:] - t[:, :-1])[1:]                        # [L-1, 10, P] cycles
    layer = (t[:, 10] - t[:, 0])[1:]                      # [L-1, P]
    out: dict = {"sm_clock_mhz": mhz, "failed": m.plan.failed(), "phases": {}}
    for i, name in enumerate(PHASES):
        mean, mx = float(d[:, i].mean(1).mean()), float(d[:, i].max(1).values.mean())
        out["phases"][name] = {"mean_cycles": mean, "max_cycles": mx,
                               "mean_us": mean / mhz if mhz else None, "max_us": mx / mhz if mhz else None}
    lm = float(layer.mean())
    out["layer_cycles"] = lm
    out["layer_us"] = lm / mhz if mhz else None
    return out


def run(name: str, bw: float, rounds: int, with_sweep: bool = True) -> dict:
    shape = SHAPES[name]
    m = Model(shape)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row: dict = {"shape": name, "layers": shape["num_hidden_layers"], "context": CONTEXT,
                 "weight_bytes": m.nbytes(), "floor_us": m.nbytes() / bw * 1e6, "rel_err": {}, "not_resident": []}
    with torch.inference_mode():
        want = m.reference()
        graphs = {"persistent": checked(m, "persistent", m.persistent, want, row),
                  "per_op": checked(m, "per_op", m.per_op, want, row),
                  "decode_layer": checked(m, "decode_layer", m.decode_layer, want, row)}
        order = ["persistent", "per_op", "decode_layer"]
        times: dict[str, list[float]] = {k: [] for k in order}
        for _ in range(rounds):  # A/B/C/C/B/A
            for k in order + order[::-1]:
                if graphs[k] is not None:
                    times[k].append(cuda_median_ms(graphs[k].replay, REPLAYS) * 1e3)
        row["us"] = {k: sorted(v)[len(v) // 2] if v else None for k, v in times.items()}
        row["us_runs"] = times
        per_layer = {k: (v / row["layers"] if v else None) for k, v in row["us"].items()}
        row["us_per_layer"] = per_layer
        row["floor_share"] = {k: (row["floor_us"] / v if v else None) for k, v in row["us"].items()}
        print(f"  {name} A/B: us {row['us']} per layer {per_layer} floor {row['floor_us']:.1f} us, "
              f"rel err {row['rel_err']}", flush=True)  # before the sweep: a run cut short keeps the A/B
        if graphs["persistent"] is not None:
            try:
                row["trace"] = traced(m, sms)
            except Exception as exc:  # noqa: BLE001 - recorded
                row["trace"] = {"error": repr(exc)[:2000]}
            print(f"  {name} trace: {json.dumps(row['trace'])}", flush=True)
        row["sweep_us"] = {}
        for label, tune in (sweep(m, sms) if with_sweep and graphs["persistent"] is not None else {}).items():
            g = checked(m, label, lambda t=tune: m.persistent(t), want, row)
            row["sweep_us"][label] = None if g is None else cuda_median_ms(g.replay, REPLAYS) * 1e3
            print(f"  {name} {label}: {row['sweep_us'][label]} us, rel err {row['rel_err'][label]:.2e}", flush=True)
            del g
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama3.2-1b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sweep-shapes", default="qwen2.5-0.5b", help="shapes that also run the launch sweep")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels.set_pdl(not args.no_pdl)  # the engine's default (EngineConfig.cuda_pdl)
    bw = copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "pdl": kernels.pdl_enabled(), "rows": []}
    print(f"{res['gpu']}, copy bandwidth {bw / 1e12:.2f} TB/s, PDL {res['pdl']}", flush=True)
    for name in args.shapes.split(","):
        try:
            row = run(name, bw, args.rounds, name in args.sweep_shapes.split(","))
        except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
            row = {"shape": name, "error": repr(exc)}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
