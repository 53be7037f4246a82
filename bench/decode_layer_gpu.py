"""Each fused decode-layer kernel (kernels.decode_layer) against the unfused kernels it replaces, on the GPU.

Per shape and weight format, a decode layer's GEMV work without the attention, batch 1, PDL on, each sequence
captured 32 times in one CUDA graph (µs per sequence, median of 20 replays):

* fused, per kernel: norm+QKV+RoPE+store, O+residual, norm+gate/up+SiLU·mul, down+residual, at a few
  launches (``DecodeLayerTuning``: the default, 1024-column K steps, no prefetch);
* unfused, per kernel: add+RMSNorm, QKV GEMV, RoPE+store, O GEMV, add+RMSNorm, gate/up GEMV, SiLU·mul, down
  GEMV (the engine's path without ``cuda_fused_decode_layers``);
* both whole sequences (8 vs 4 launches), the floor (weight bytes at the measured copy bandwidth).

    python -m bench.decode_layer_gpu --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import kernels
from bench.engine_gpu import SHAPES, copy_bandwidth
from bench.gemv_int4_gpu import graph_us as gemv_graph_us
from engine.fused import quantize_int4_rtn
from kernels.decode_layer import RESIDUAL, ROPE, SILU, _default_tuning

REPS = 32


def graph_us(fn) -> float:
    """µs per call of ``fn`` from a CUDA graph of REPS calls (median of 20 replays)."""
    return gemv_graph_us([fn], launches=REPS, replays=20)


class Layer:
    """Random weights of one decoder layer in a real shape, bf16 or int4 (group 32), and its buffers."""

    def __init__(self, shape: dict, fmt: str, dev: str = "cuda") -> None:
        d, hq, hkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
        hidden, inter = shape["hidden_size"], shape["intermediate_size"]
        bf = torch.bfloat16
        self.hq, self.hkv, self.d = hq, hkv, d

        def w(n, k):
            t = torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5
            return (t, None) if fmt == "bf16" else _int4(t)
        self.qkv, self.o = w((hq + 2 * hkv) * d, hidden), w(hidden, hq * d)
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)
        self.bias = torch.randn((hq + 2 * hkv) * d, device=dev, dtype=bf) if shape.get("attention_bias") else None
        self.g1, self.g2 = (torch.ones(hidden, device=dev, dtype=bf) for _ in range(2))
        self.h = torch.randn(1, hidden, device=dev, dtype=bf)
        self.res = torch.randn(1, hidden, device=dev, dtype=bf)
        self.attn = torch.randn(1, hq * d, device=dev, dtype=bf)
        self.act = torch.randn(1, inter, device=dev, dtype=bf)
        self.cos, self.sin = torch.ones(1, d, device=dev), torch.zeros(1, d, device=dev)
        self.kc = torch.zeros(64, 16, hkv, d, device=dev, dtype=bf)
        self.vc = torch.zeros_like(self.kc)
        self.slots = torch.tensor([100], device=dev)
        self.eps = 1e-6

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in (self.qkv, self.o, self.gate_up, self.down)
                   for t in w if t is not None)

    # the fused kernels
    def f_qkv(self, tune=None):
        w, so = self.qkv
        return kernels.norm_qkv_rope_store(self.h, self.g1, self.eps, w, self.bias, self.hq, self.hkv, self.cos,
                                           self.sin, self.kc, self.vc, self.slots, so, tuning=tune)

    def f_o(self, tune=None):
        return kernels.gemv_add_residual(self.attn, self.o[0], self.res, self.o[1], tuning=tune)

    def f_gate_up(self, tune=None):
        return kernels.norm_gate_up_silu(self.h, self.g2, self.eps, *self.gate_up, tuning=tune)

    def f_down(self, tune=None):
        return kernels.gemv_add_residual(self.act, self.down[0], self.res, self.down[1], tuning=tune)

    # the unfused kernels
    def _lin(self, x, w, bias=None):
        if w[1] is None:
            return kernels.gemv(x, w[0], bias)
        return kernels.gemv_int4_w32(x, w[0], w[1], bias)

    def u_norm(self):
        return kernels.add_rms_norm(self.h, self.res, self.g1, self.eps)

    def u_qkv(self):
        return self._lin(self.h, self.qkv, self.bias)

    def u_rope_store(self, qkv):
        return kernels.rope_store_kv(qkv, self.hq, self.hkv, self.cos, self.sin, self.kc, self.vc, self.slots)

    def u_o(self):
        return self._lin(self.attn, self.o)

    def u_gate_up(self):
        return self._lin(self.h, self.gate_up)

    def u_silu(self, gu):
        return kernels.silu_mul(gu)

    def u_down(self):
        return self._lin(self.act, self.down)


def _int4(t: torch.Tensor):
    q = quantize_int4_rtn(t, 32)
    return q.qweight, q.scale_offset


# launches timed per fused kernel: the default (kernels.decode_layer._default_tuning) and changes of it
VARIANTS = {"default": {}, "k x2": {"block_k": 2}, "rows x2": {"block_n": 2}, "no prefetch": {"prefetch": False}}


def tuning(variant: str, fmt: str, k: int, epi: int) -> kernels.DecodeLayerTuning | None:
    """The variant's launch for a weight of K columns under epilogue ``epi`` (None: the default)."""
    if not VARIANTS[variant]:
        return None
    base = _default_tuning(fmt == "int4", k, 32, epi)
    change = {f: (getattr(base, f) * v if f != "prefetch" else v) for f, v in VARIANTS[variant].items()}
    return dataclasses.replace(base, **change)


def run(shape_name: str, fmt: str, bw: float) -> dict:
    lay = Layer(SHAPES[shape_name], fmt)
    row = {"shape": shape_name, "format": fmt, "floor_us": lay.nbytes() / bw * 1e6, "fused": {}, "unfused": {}}
    shape = SHAPES[shape_name]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    ops = {"qkv": (lay.f_qkv, hidden, ROPE), "o": (lay.f_o, lay.hq * lay.d, RESIDUAL),
           "gate_up": (lay.f_gate_up, hidden, SILU), "down": (lay.f_down, inter, RESIDUAL)}
    for name in VARIANTS:
        tunes = {op: tuning(name, fmt, k, epi) for op, (_, k, epi) in ops.items()}
        row["fused"][name] = {op: graph_us(lambda f=f, t=tunes[op]: f(t)) for op, (f, _, _) in ops.items()}
        row["fused"][name]["layer"] = graph_us(lambda t=tunes: (
            lay.f_qkv(t["qkv"]), lay.f_o(t["o"]), lay.f_gate_up(t["gate_up"]), lay.f_down(t["down"])))
    qkv, gu = lay.u_qkv(), lay.u_gate_up()
    row["unfused"] = {"add_rms_norm": graph_us(lay.u_norm), "qkv": graph_us(lay.u_qkv),
                      "rope_store": graph_us(lambda: lay.u_rope_store(qkv)), "o": graph_us(lay.u_o),
                      "gate_up": graph_us(lay.u_gate_up), "silu_mul": graph_us(lambda: lay.u_silu(gu)),
                      "down": graph_us(lay.u_down)}

    def unfused_layer():
        lay.u_norm()
        lay.u_rope_store(lay.u_qkv())
        lay.u_o()
        lay.u_norm()
        lay.u_silu(lay.u_gate_up())
        lay.u_down()
    row["unfused"]["layer"] = graph_us(unfused_layer)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama3.2-1b")
    ap.add_argument("--formats", default="bf16,int4")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels.set_pdl(not args.no_pdl)
    bw = copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "pdl": kernels.pdl_enabled(), "rows": []}
    print(f"{res['gpu']}, copy bandwidth {bw / 1e12:.2f} TB/s, PDL {res['pdl']}", flush=True)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for fmt in args.formats.split(","):
                try:
                    row = run(shape, fmt, bw)
                except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
                    row = {"shape": shape, "format": fmt, "error": repr(exc)}
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
