"""CPU cost of one encrypted SmolLM2 MLP block per token (client-aided SiLU), and the bytes per round trip.

Ours (:mod:`fhe.mlp`, the hybrid BSGS products on the SEAL backend at the MLP's own N = 8192 parameters)
against the peers a user would pick instead, in the same run: TenSEAL's own ``CKKSVector.mm`` for the same
two products (same parameters), and the plaintext MLP in torch (what the client would spend running the
block itself). Real layer weights when the default model is cached, else random ones in the real shape
(speed does not depend on the values).

    flock /tmp/cipherlm-bench.lock python bench/fhe_mlp.py --layer 2 --tokens 5
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer
from fhe.backends.seal.keys import CKKSClient
from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient, MLPWeights


def _layer(index: int) -> tuple[DecoderLayer, str]:
    try:
        from engine.default_model import default_model_dir
        from engine.loader import load_model

        return load_model(default_model_dir()).layers[index], f"SmolLM2-135M-Instruct layer {index}"
    except Exception as exc:  # noqa: BLE001 - no cached model: random weights in the same shape
        print(f"(no default model: {exc}; random weights)")
        cfg = ModelConfig(49152, 576, 1536, 30, 9, 3, 64)
        torch.manual_seed(0)
        layer = DecoderLayer(cfg, index)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.04)
        return layer, "random SmolLM2-shaped layer"


def _time(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_ours(layer: DecoderLayer, hs: torch.Tensor) -> dict:
    setup, server = _time(lambda: EncryptedMLP(layer, MLP_PARAMS))
    keygen, client = _time(lambda: CKKSClient(MLP_PARAMS, tuple(server.rotation_steps)))
    keys, mc = client.server_keys(), MLPClient(client, server.layout, layer.post_attention_layernorm.eps)
    ev, ref_layer = server.ev, copy.deepcopy(layer).double()
    rows: dict[str, list[float]] = {k: [] for k in ("client_enc1", "server_gate_up", "client_silu_enc2",
                                                     "server_down", "client_dec", "total")}
    errs, up1, down1, up2, down2 = [], 0, 0, 0, 0
    for h in hs:
        t1, ct = _time(lambda h=h: mc.encrypt_input(h))
        t2, gu = _time(lambda ct=ct: server.gate_up(ct, keys))
        t3, ct2 = _time(lambda gu=gu: mc.encrypt_activation(mc.activation(gu)))
        t4, out = _time(lambda ct2=ct2: server.down(ct2, keys))
        t5, y = _time(lambda out=out: mc.output(out))
        for k, v in zip(rows, (t1, t2, t3, t4, t5, t1 + t2 + t3 + t4 + t5), strict=True):
            rows[k].append(v)
        with torch.no_grad():
            x = h.double()   # the norm in fp64 (the module's fp32 norm would set the error)
            x = ref_layer.post_attention_layernorm.weight * x * torch.rsqrt(x.pow(2).mean() + mc.eps)
            ref = ref_layer.mlp(x)
        errs.append(float((y - ref).abs().max()))
        # what goes over the wire: seeded fresh uploads (SEAL's seeded form), level-1 downloads
        up1 = up2 = len(client.encrypt_bytes(np.random.default_rng(0).standard_normal(ev.slots)))
        down1, down2 = sum(len(ev.serialize(c)) for c in gu), len(ev.serialize(out))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"setup_s": setup, "keygen_s": keygen, "rotation_keys": len(server.rotation_steps),
            "key_mb": sum(map(len, client.public_blobs.values())) / 1e6, "max_err": max(errs), **med,
            "bytes": {"up_x": up1, "down_gate_up": down1, "up_act": up2, "down_out": down2},
            "packed": server.layout.packed}


def bench_tenseal(w: MLPWeights, x: np.ndarray, a: np.ndarray, reps: int) -> dict:
    import tenseal as ts

    p = MLP_PARAMS
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, p.poly_modulus_degree, coeff_mod_bit_sizes=list(p.coeff_mod_bit_sizes))
    ctx.global_scale = 2.0 ** p.scale_bits
    ctx.generate_galois_keys()
    wgu, wd = np.concatenate([w.gate, w.up]).T.tolist(), w.down.T.tolist()
    ts_up, ts_down = [], []
    for _ in range(reps):
        v = ts.ckks_vector(ctx, x.tolist())
        ts_up.append(_time(lambda v=v: v.mm(wgu))[0])
        v2 = ts.ckks_vector(ctx, a.tolist())
        ts_down.append(_time(lambda v2=v2: v2.mm(wd))[0])
    return {"gate_up": statistics.median(ts_up), "down": statistics.median(ts_down)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--tenseal-reps", type=int, default=1, help="0 skips TenSEAL's mm")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layer, what = _layer(args.layer)
    hs = torch.randn(args.tokens, 576, generator=torch.Generator().manual_seed(0)) * 2
    ours = bench_ours(layer, hs)
    w = MLPWeights.of(layer)
    x = (hs[0] * torch.rsqrt(hs[0].pow(2).mean() + 1e-5)).double().numpy()
    a = np.random.default_rng(0).standard_normal(w.intermediate)
    peer = bench_tenseal(w, x, a, args.tenseal_reps) if args.tenseal_reps else None
    plain = statistics.median(_time(lambda h=h: layer.mlp(layer.post_attention_layernorm(h)))[0] for h in hs)
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{what}, N={MLP_PARAMS.poly_modulus_degree} {MLP_PARAMS.coeff_mod_bit_sizes} 2^{MLP_PARAMS.scale_bits}, "
          f"{args.tokens} tokens, {torch.get_num_threads()} torch threads")
    print(f"setup (encode weights) {ours['setup_s']:.2f} s, keygen {ours['keygen_s']:.2f} s, "
          f"{ours['rotation_keys']} Galois keys, {ours['key_mb']:.1f} MB public keys, packed={ours['packed']}")
    print("| step | ours, median s/token | TenSEAL mm (same params) |")
    print("|---|---|---|")
    for k in ("client_enc1", "server_gate_up", "client_silu_enc2", "server_down", "client_dec", "total"):
        ts_cell = "-" if peer is None else {"server_gate_up": f"{peer['gate_up']:.2f}",
                                            "server_down": f"{peer['down']:.2f}"}.get(k, "-")
        print(f"| {k} | {ours[k]:.3f} | {ts_cell} |")
    print(f"plaintext torch MLP (client alone): {plain * 1e3:.2f} ms/token; max |enc - torch| {ours['max_err']:.2e}")
    b = ours["bytes"]
    print(f"bytes: up x̂ {b['up_x']}, down gate|up {b['down_gate_up']}, up silu*u {b['up_act']}, "
          f"down out {b['down_out']}; per token {sum(b.values())} over 2 round trips")


if __name__ == "__main__":
    main()
