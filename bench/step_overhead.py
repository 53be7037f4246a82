"""Where one linear step's time goes outside the evaluator: HTTP, envelope, pipe, SEAL parse and serialize.

One run, SmolLM2's real layer ``--layer`` (default 2) as an offload plan of linear steps only (its attention
as ``attn_qkv`` / ``attn_o`` and its MLP on the server, every other layer on the client), SEAL workers:

1. **round trip**: ``cipherlm serve`` (one worker), then ``--steps`` ``mlp_up`` steps of one position each,
   sent as the SDK sends them (``OffloadSession.mlp_call`` through the client's exchange), the ciphertexts
   encrypted beforehand; the client's wall time per step;
2. **pieces**, each alone in this process on the same ciphertext (median of ``--repeat``): the server
   process's envelope parse and SHA-256 retry digest and result envelope, the pipe round trip to a child
   process with the step's arguments and answer (pickling both ways), and the worker's SEAL parse + check,
   evaluator and SEAL serialization of the result.

The overhead is the stored-answer round trip (the same request again: HTTP both ways, the SDK, auth, the
envelope and the retry digest, no worker) plus the worker hop (pipe, SEAL parse and serialize); ``round trip -
evaluator`` is printed beside it, but the evaluator alone varies by a few ms. ``gpu_*``: the gpu backend's
host-side conversions (its CPU reference), with the result written through SEAL or directly. Example::

    PYTHONPATH=. flock /tmp/cipherlm-bench.lock python bench/step_overhead.py --json bench/results/x.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _echo(conn, answer: bytes) -> None:
    """A child process that answers every (method, args) with a result of the step's size (the pipe alone)."""
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        conn.send(("ok", [answer]))


def offload_plan_file(layer: int, root: Path) -> Path:
    from engine.config import ModelConfig
    from engine.default_model import default_model_dir
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan

    cfg = ModelConfig.from_hf_dict(json.loads((default_model_dir() / "config.json").read_text()))
    layers = [LayerPlacement(i, SERVER, SERVER, "client", "client") if i == layer else LayerPlacement(i, CLIENT, CLIENT)
              for i in range(cfg.num_hidden_layers)]
    return OffloadPlan("SmolLM2-135M-Instruct", cfg.to_hf_dict(), layers).save(root / "step-overhead.offload.json")


def pieces(layer: int, plan_path: Path, repeat: int) -> dict[str, float]:
    """Each piece of one ``mlp_up`` step alone (seconds, median)."""
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe import envelope
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.envelope import pack_key_upload, parse_key_upload
    from fhe.fingerprint import params_hash
    from server.private.compute import _OffloadLinear

    linear = _OffloadLinear(load_model(default_model_dir()), str(plan_path), "cpu")
    client = CKKSClient(linear.params, linear.steps)
    upload = pack_key_upload(wire.dump_public_keys(client))
    keys = wire.load_server_keys(parse_key_upload(upload, len(upload)), linear.params, linear.steps)
    fp = hashlib.sha256(upload).hexdigest()
    linear.load_key(fp, keys)
    block, _ = linear.part(layer, "mlp_up")
    blob = wire.encrypt_to_wire(client, np.random.default_rng(0).normal(size=linear.params.slots) * 0.1)
    body = envelope.Envelope("ps_x", fp, layer, "decode", (5, 1), (blob,), "seal", params_hash(linear.params),
                             "mlp_up").to_bytes()

    def parse_in():
        ct = wire.load_ciphertext(blob, keys.kit, keys.fingerprint, level=block.ev.top)
        keys.check_input(ct)
        return ct

    ct = parse_in()
    outs = linear.run(fp, layer, "mlp_up", [ct])
    result = [wire.dump_ciphertext(c, linear.params, keys.fingerprint) for c in outs]
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_echo, args=(child, result[0]), daemon=True)
    proc.start()

    def pipe():
        parent.send(("mlp_step", (fp, layer, "mlp_up", [blob])))
        parent.recv()

    pipe()
    out = {"envelope_parse": _median_s(lambda: envelope.parse(body, 16 << 20, 256 << 20), repeat),
           "sha256_digest": _median_s(lambda: hashlib.sha256(body).hexdigest(), repeat),
           "pipe_round_trip": _median_s(pipe, repeat),
           "seal_parse_check": _median_s(parse_in, repeat),
           "evaluator": _median_s(lambda: linear.run(fp, layer, "mlp_up", [ct]), max(3, repeat // 4)),
           "seal_serialize": _median_s(lambda: [wire.dump_ciphertext(c, linear.params, keys.fingerprint)
                                                for c in outs], repeat),
           "result_envelope": _median_s(lambda: envelope.Envelope("ps_x", fp, layer, "result", (5, 1), tuple(result),
                                                                  "seal", params_hash(linear.params),
                                                                  "mlp_up").to_bytes(), repeat),
           **gpu_conversions(linear, keys, ct, repeat),
           "bytes_up": len(body), "bytes_down": sum(len(r) for r in result) + 200}
    parent.close()
    proc.join(5)
    return out


def gpu_conversions(linear, keys, ct, repeat: int) -> dict[str, float]:
    """The gpu backend's host-side conversions of one step (its torch-CPU reference here: the same host work
    as on a GPU machine but the copies to and from the device): SEAL ciphertext -> device, and a level-1
    result -> wire through SEAL (load, then save with zstd) or directly (``wire.pack_ciphertext``)."""
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire

    gpu = GpuEvaluator(linear.params, "cpu", encoder="seal")
    res = gpu.mod_switch(gpu.deserialize(seal.to_bytes(ct)), 1)
    fp = keys.fingerprint
    return {"gpu_in_convert": _median_s(lambda: gpu.deserialize(seal.to_bytes(ct)), repeat),
            "gpu_out_via_seal": _median_s(lambda: wire.dump_ciphertext(
                seal.from_bytes("ciphertext", keys.kit, gpu.serialize(res)), linear.params, fp), repeat),
            "gpu_out_direct": _median_s(lambda: wire.pack_ciphertext(gpu.serialize(res), linear.params, fp),
                                        repeat)}


def round_trips(layer: int, plan_path: Path, steps: int, root: Path) -> list[float]:
    """Client wall seconds of ``steps`` one-position ``mlp_up`` steps through ``cipherlm serve``."""
    from client_sdk import Client
    from fhe.backends.seal import wire
    from fhe.fingerprint import params_hash
    from server.cli_demo import client_timeout, prepare_private, running_server

    with running_server(root, None, None, 1, offload=plan_path) as server:
        with Client(api_key=server.keys["demo-encrypted"], base_url=server.url, privacy="encrypted",
                    timeout=client_timeout()) as client:
            rt, _ = prepare_private(client, root / "client")
            rt.open_session()
            off, rng = rt.offload, np.random.default_rng(1)
            blobs = [wire.encrypt_to_wire(off.ckks, rng.normal(size=off.params.slots) * 0.1) for _ in range(steps + 1)]
            ph, times, again = params_hash(off.params), [], []
            for i, blob in enumerate(blobs):
                call = rt.session.mlp_call(layer, "mlp_up", i, (blob,), ph)
                t0 = time.perf_counter()
                rt.exchange(call)
                t1 = time.perf_counter()
                rt.exchange(call)   # the same request again: the stored answer, no worker (retry-safe steps)
                if i:   # the first one warms the worker's path
                    times.append(t1 - t0)
                    again.append(time.perf_counter() - t1)
            rt.close_session()
    return times, again


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        root = Path(tmp)
        plan_path = offload_plan_file(args.layer, root)
        (root / "serve").mkdir()
        rtt, stored = round_trips(args.layer, plan_path, args.steps, root / "serve")
        parts = pieces(args.layer, plan_path, args.repeat)
    rtt_med, http = statistics.median(rtt), statistics.median(stored)
    overhead = rtt_med - parts["evaluator"]
    worker_side = sum(parts[k] for k in ("pipe_round_trip", "seal_parse_check", "seal_serialize"))
    print(f"| piece (one mlp_up step, layer {args.layer}, one position) | ms |\n|---|---:|")
    print(f"| round trip through `cipherlm serve` (median of {len(rtt)}) | {rtt_med * 1e3:.2f} |")
    print(f"| the same request again (stored answer: HTTP, SDK, envelope, auth; no worker) | {http * 1e3:.2f} |")
    for k, v in parts.items():
        if not k.startswith("bytes"):
            print(f"| {k} | {v * 1e3:.2f} |")
    print(f"| **overhead** = request path without a worker + worker hop | **{(http + worker_side) * 1e3:.2f}** |")
    print(f"| (round trip - evaluator: {overhead * 1e3:.2f}, within the evaluator's own spread of a few ms) | |")
    print(f"\nbytes up {parts['bytes_up']}, down ~{parts['bytes_down']}; " + " ".join(sys.argv))
    if args.json:
        args.json.write_text(json.dumps({"round_trip_s": rtt, "round_trip_median_s": rtt_med, "pieces_s": parts,
                                         "stored_answer_s": stored, "stored_answer_median_s": http,
                                         "overhead_s": overhead, "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
