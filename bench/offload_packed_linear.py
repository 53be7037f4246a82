"""Several positions per ciphertext in the offload plan's linear steps (issues 17/18, item 1): per part at
SmolLM2-135M's shapes, the one-position hybrid product (:class:`fhe.linalg.HybridMatvec`) against the
position-interleaved chunk layout, in the same run, on the SEAL backend at
:data:`fhe.mlp.MLP_PARAMS` (N = 8192, 4096 slots). Random weights (the cost does not depend on them).

Per part and m: plaintext products and rotations per ciphertext and per position, server seconds per
position (the encoded product + fold, median of ``--reps``), client encrypt + decrypt seconds per position,
and fresh-up / level-1-down bytes per position. ``--chunk 4 8`` (issue 18 item 2) adds the chunk layout
(:mod:`fhe.interleaved`: T tile ciphertexts in, G out per m positions) at those m, timed the same way.
(pack17's m-position block layout, which this script also timed until session 13, was removed from
``fhe.linalg``; its rows in docs/benchmarks.md stand as measured.)

    flock /tmp/cipherlm-bench.lock python bench/offload_packed_linear.py --chunk 4 8 \
        --out bench/results/offload_packed_linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from fhe.backends import evaluator_for
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.interleaved import chunk_shape
from fhe.linalg import HybridMatvec, hybrid_slots, pick_fold, replicate_input, rotate_sum_steps
from fhe.mlp import MLP_PARAMS

#: (n_out, n_in) of SmolLM2-135M's four linear steps
PARTS = {"attn_qkv": (960, 576), "attn_o": (576, 576), "mlp_up": (3072, 576), "mlp_down": (576, 1536)}


def layouts(slots: int, n_in: int, n_out: int, rng) -> dict[int, HybridMatvec]:
    w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    fold, period = pick_fold(slots, n_in, n_out)
    return {1: HybridMatvec(slots, w, hybrid_slots(slots, period, fold, n_out), period, fold)}


def rotations(mv: HybridMatvec) -> int:
    st = mv.map.steps
    return (st.n_baby - 1) + (st.n_giant - 1) + len(rotate_sum_steps(mv.window, mv.fold))


def _chunk_row(ev, part: str, n_in: int, n_out: int, m: int, rng, reps: int) -> dict:
    """The chunk layout of m positions: T ciphertexts in, G out, timed like the rows above."""
    sh = chunk_shape(ev.slots, n_in, n_out, m)
    w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    client = CKKSClient(MLP_PARAMS, tuple(sorted(sh.rotation_steps)))
    keys = client.server_keys()
    enc = sh.encode(ev, w, ev.top)
    xs = rng.standard_normal((m, n_in))
    srv, cli = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cts = [client.encrypt(v) for v in sh.pack(xs)]
        t1 = time.perf_counter()
        res = enc(ev, cts, keys)
        t2 = time.perf_counter()
        got = sh.unpack([client.decrypt(c) for c in res], m)
        t3 = time.perf_counter()
        srv.append(t2 - t1)
        cli.append((t1 - t0) + (t3 - t2))
    err = float(np.abs(got - xs @ w.T).max())
    row = dict(part=part, layout="interleaved", m=m, tile=sh.tile, baby=sh.baby, tiles=sh.tiles, groups=sh.groups,
               plain_products=sum(len(g) for g in enc.plaintexts.values()), rotations=sh.rotations,
               server_s_per_position=statistics.median(srv) / m, client_s_per_position=statistics.median(cli) / m,
               up_bytes_per_position=sum(len(seal.to_bytes(c)) for c in cts) / m,
               down_bytes_per_position=sum(len(seal.to_bytes(c)) for c in res) / m, max_err=err)
    print(f"{part:9s} interleaved m={m} tile={sh.tile} baby={sh.baby} T={sh.tiles} G={sh.groups}"
          f" pt/pos={row['plain_products'] / m:.0f} rot/pos={sh.rotations / m:.1f}"
          f" server {row['server_s_per_position'] * 1e3:.1f} ms/pos  client {row['client_s_per_position'] * 1e3:.1f}"
          f" ms/pos  up {row['up_bytes_per_position'] / 1e3:.0f} kB/pos  down"
          f" {row['down_bytes_per_position'] / 1e3:.0f} kB/pos  err {err:.1e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--chunk", type=int, nargs="*", default=[],
                    help="also the position-interleaved chunk layout (fhe/interleaved.py) at these m")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ev = evaluator_for(MLP_PARAMS, "seal")
    rows = []
    for part, (n_out, n_in) in PARTS.items():
        mvs = layouts(ev.slots, n_in, n_out, rng)
        steps = set()
        for mv in mvs.values():
            steps |= mv.rotation_steps
        client = CKKSClient(MLP_PARAMS, tuple(sorted(steps)))
        keys = client.server_keys()
        for m, mv in mvs.items():
            enc = mv.encode(ev, ev.top)
            xs = rng.standard_normal((m, n_in))
            srv, cli = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                ct = client.encrypt(replicate_input(xs[0], ev.slots, mv.period))
                t1 = time.perf_counter()
                res = ev.mod_switch(enc(ev, ct, keys), 1)
                t2 = time.perf_counter()
                got = client.decrypt(res)[mv.out_slots[None, :]]
                t3 = time.perf_counter()
                srv.append(t2 - t1)
                cli.append((t1 - t0) + (t3 - t2))
            err = float(np.abs(got - xs @ mv.weight.T).max())
            row = dict(part=part, m=m, fold=mv.fold, period=mv.period, plain_products=mv.map.num_diagonals,
                       rotations=rotations(mv), server_s_per_position=statistics.median(srv) / m,
                       client_s_per_position=statistics.median(cli) / m,
                       up_bytes_per_position=len(seal.to_bytes(ct)) / m,
                       down_bytes_per_position=len(seal.to_bytes(res)) / m, max_err=err)
            rows.append(row)
            print(f"{part:9s} m={m} c={mv.fold} P={mv.period} pt/ct={row['plain_products']} rot/ct={row['rotations']}"
                  f" pt/pos={row['plain_products'] / m:.0f} rot/pos={row['rotations'] / m:.1f}"
                  f" server {row['server_s_per_position'] * 1e3:.1f} ms/pos"
                  f"  client {row['client_s_per_position'] * 1e3:.1f} ms/pos"
                  f"  up {row['up_bytes_per_position'] / 1e3:.0f} kB/pos  down"
                  f" {row['down_bytes_per_position'] / 1e3:.0f} kB/pos  err {err:.1e}", flush=True)
        for m in args.chunk:
            rows.append(_chunk_row(ev, part, n_in, n_out, m, rng, args.reps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
