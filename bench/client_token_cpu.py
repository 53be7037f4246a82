"""The SDK's own work per decode token of a private generation, piece by piece, without a server.

A decode token of the shipped plan (4 encrypted attention layers) costs the client: the clear forward of one
token (26 clear attention layers, 30 MLPs, the embedding) with 4 encrypted layers' inputs laid out and
encrypted and their level-1 answers parsed, decrypted and normalized, then the head. ``bench/private_e2e.py``
measures the same split end to end with a server (minutes per token on a 2-core box); this measures the
client's pieces in seconds, so a change to them is quick to compare before/after:

* ``clear@T``: :meth:`PrivateRuntime.forward`'s model call for one token at context ``--context`` (the engine's
  forward through the SDK's client model), its encrypted layers answered by a stub that returns zeros;
* ``head@T``: final norm + LM head of the last row (both rows under each ``--threads`` count T: ``torch``,
  torch's default, the SDK's count before session 22; ``auto``, what :mod:`client_sdk._threads` applies now);
* ``upload``: one encrypted layer's input laid out (``BlockClient.layout_input``), encrypted on a zero made
  ahead and serialized full (``ZerosAhead``'s path: the zero itself is made off the critical path and timed
  apart as ``zero``), and seeded (SEAL's own encryption, the seeded manifests' path);
* ``answer``: one level-1 answer blob parsed (``wire.load_ciphertext``), decrypted, split into y/z
  (``BlockClient.decrypt_output``) and normalized (``BlockClient.finish``); ``answer_fresh_decryptor``: the same
  with a SEAL decryptor made for the call, as before session 22.

Per token: clear + head + layers x (upload + answer) (``token_full``: the GPU server's full uploads). Example::

    flock /tmp/cipherlm-bench.lock nice env PYTHONPATH=. python bench/client_token_cpu.py --repeat 10
    flock /tmp/cipherlm-bench.lock nice env PYTHONPATH=. python bench/client_token_cpu.py --busy 1 --repeat 5

``--busy 1``: one other process keeps a core busy during the run (a spinning loop), as a server or other work
beside the SDK does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch


class _ZeroAnswers:
    """An AttentionBackend: clear layers on a dense cache, encrypted layers answered with zeros."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def attend(self, layer, q, k, v):
        return self.cache.attend(layer, q, k, v)

    def attend_encrypted(self, layer, x, positions):
        return torch.zeros_like(x)


def _ms(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _client(plan):
    """The SDK's client model and one BlockClient per encrypted layer, under a key set without evaluation keys
    (the client only encrypts and decrypts)."""
    from client_sdk._runtime import client_model
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.attention import BlockClient
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import CKKSParams

    model = client_model(load_model(default_model_dir(), dtype=torch.float32), tuple(lp.index for lp in plan.layers))
    ckks = CKKSClient(CKKSParams.from_dict(dict(plan.ckks)), ())
    blocks = {lp.index: BlockClient.for_model(ckks, model.config, lp.approx.kind, lp.approx.squarings)
              for lp in plan.layers}
    return model, ckks, blocks


def _answer_blob(ckks, block) -> bytes:
    """A level-1 ciphertext of a plausible answer (y small, z positive), serialized as the server sends it."""
    from fhe.backends.seal import wire

    rng = np.random.default_rng(0)
    vec = np.zeros(block.layout.slots)
    ys, zs = block.layout.output_slots()
    vec[ys] = rng.standard_normal(np.shape(ys)) * 0.1
    vec[zs] = 1.0 + rng.random(np.shape(zs))
    ct = ckks.kit.drop_to(ckks.encrypt(vec), 1)
    return wire.dump_ciphertext(ct, ckks.params, ckks.fingerprint)


def measure(context: int, repeat: int, scopes: dict, rounds: int = 3) -> dict:
    """Median ms of each piece (see the module docstring); the clear rows under each of ``scopes`` (thread
    settings by row name), in turn for ``rounds`` rounds (median of the rounds' medians)."""
    from engine.model import DenseKVCache
    from fhe.backends.seal import hazmat, wire
    from fhe.plan import load_default_plan

    plan = load_default_plan()
    model, ckks, blocks = _client(plan)
    layer = plan.layers[0].index
    block = blocks[layer]
    cache = DenseKVCache(model.config, context + 1)
    backend = _ZeroAnswers(cache)
    with torch.inference_mode():
        model(torch.arange(context) % 1000, torch.arange(context), backend)   # the context, once
        cache.advance()
        tok, pos = torch.tensor([42]), torch.tensor([context])
        h = model(tok, pos, backend)
        x = torch.randn(1, model.config.hidden_size, dtype=torch.float32)
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
        blob = _answer_blob(ckks, block)

        def upload_full():
            return wire.encrypt_to_wire(ckks, block.layout_input(x[0]), seeded=False, zero=zeros.pop())

        def answer():
            ct = wire.load_ciphertext(blob, ckks.kit, ckks.fingerprint)
            return block.finish(*block.decrypt_output([ct]))

        def answer_fresh_decryptor():   # the path before session 22: a SEAL decryptor made per decryption
            ct = wire.load_ciphertext(blob, ckks.kit, ckks.fingerprint)
            vec = hazmat.decrypt(ckks.kit, ckks.keys.secret, ct)
            y, z = block.layout.split_output(vec)
            return block.finish(torch.from_numpy(y[None]), torch.from_numpy(z[None]))

        zeros = [ckks.encrypt_zero() for _ in range(repeat + 1)]
        out = {}
        used: dict[str, list] = {}
        for _ in range(rounds):   # rows of the clear work under each thread setting, in turn
            for name, scope in scopes.items():
                def step(scope=scope, name=name):   # as PrivateRuntime.forward: the scope's count taken at each step
                    with scope.applied():   # the cache is not advanced: every call at the same context
                        model(tok, pos, backend)
                    used.setdefault(name, []).append(scope.count)

                def head(scope=scope):
                    with scope.applied():
                        model.logits(h[-1:])
                out.setdefault(f"clear@{name}", []).append(_ms(step, repeat))
                out.setdefault(f"head@{name}", []).append(_ms(head, repeat))
        out = {k: statistics.median(v) for k, v in out.items()}
        out |= {
            "layout": _ms(lambda: block.layout_input(x[0]), repeat),
            "zero": _ms(ckks.encrypt_zero, repeat),
            "upload_full": _ms(upload_full, repeat),
            "upload_seeded": _ms(lambda: wire.encrypt_to_wire(ckks, block.layout_input(x[0])), repeat),
            "answer": _ms(answer, repeat),
            "answer_fresh_decryptor": _ms(answer_fresh_decryptor, repeat),
            "parse": _ms(lambda: wire.load_ciphertext(blob, ckks.kit, ckks.fingerprint), repeat),
        }
    n = len(plan.layers)
    for name in scopes:
        clear = out[f"clear@{name}"] + out[f"head@{name}"]
        out[f"token_full@{name}"] = clear + n * (out["upload_full"] + out["answer"])
        out[f"token_seeded@{name}"] = clear + n * (out["upload_seeded"] + out["answer"])
    counts = {name: sorted(set(c)) for name, c in used.items()}
    return {"encrypted_layers": n, "context": context, "threads": counts, "ms": out}


def thread_scopes(spec: str) -> dict[str, object]:
    """``--threads`` -> {row name: ThreadScope}: ``torch`` (torch's count at start, the SDK before session 22),
    ``auto`` (``client_sdk._threads``' policy, what the SDK applies since: per step, the physical cores minus the
    tasks running elsewhere), or a number."""
    from client_sdk._threads import ThreadScope

    out = {}
    for word in spec.split(","):
        word = word.strip()
        scope = out[word] = ThreadScope()
        if word == "auto":
            scope.choose()
        else:
            scope.fixed = torch.get_num_threads() if word == "torch" else int(word)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32, help="positions already in the cache")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", default="torch,auto",
                   help="thread counts of the clear rows: torch (its default), auto (the SDK's policy), numbers")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the clear rows, thread counts in turn")
    p.add_argument("--busy", type=int, default=0,
                   help="processes that each keep one core busy (a spinning loop) during the run: the SDK sharing "
                        "its machine with other work, as beside a server on the same host")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        res = measure(args.context, args.repeat, thread_scopes(args.threads), args.rounds)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    res["busy_processes"] = args.busy
    res.update(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", machine=platform.machine(),
               cpus=os.cpu_count(), load=os.getloadavg()[0])
    print(f"client work of one decode token ({res['encrypted_layers']} encrypted layers, context {args.context}; "
          f"{args.busy} core(s) kept busy by other processes; "
          f"median of {args.repeat}; thread counts used {res['threads']}; load {res['load']:.2f}):")
    for k, v in res["ms"].items():
        print(f"  {k:14s} {v:8.2f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
