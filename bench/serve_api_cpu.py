"""The API process under a GPU's load, on the CPU: ``cipherlm serve`` with a model-free engine core.

On a GPU the engine core steps 256 rows in a few ms, so at 256 streamed users the API process (HTTP,
SSE framing, rebuilding outputs from the core's deltas) can be what bounds the served rate
(docs/benchmarks.md, "Serving at 256 users"). On this machine's CPU a real model is far slower than the
API, so ``bench/serve_bench.py`` here measures the model. This script serves the real app, the real
tokenizer and the real engine core (scheduler, detokenizer, outputs, the pipe), but the core's executor is
``bench/engine_host_cpu.py``'s stub: no forward, logits that pick ordinary word tokens, so the core runs
at its host speed (~2-3 ms per 256-row step, as on a GPU) and the API process's own CPU per token shows.
``CIPHERLM_BENCH_STEP_MS`` (server environment: ``--variant label:env.CIPHERLM_BENCH_STEP_MS=4``) puts a floor
under each step as a GPU's step time would, ``CIPHERLM_BENCH_EAGER_STEP_MS`` a different one under the steps
no decode graph takes.

Per round and variant (a ``--server-set`` / ``--engine-set`` group), the same streamed load as
``serve_bench.py`` (``--request-rate inf``, ``--users`` in flight, ``--clients`` processes) against a
fresh server; rows: out tok/s, TPOT/ITL, chunks per token and CPU µs per token of the API process, the
core and the clients. Variants alternate within a round (A B, B A, ...).

    python -m bench.serve_api_cpu --tok DIR --users 256 --rounds 2 \\
        --variant default: --variant nocoalesce:stream_coalesce_streams=0

``--serve CONFIG`` (internal): run the server process itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

STEP_S = float(os.environ.get("CIPHERLM_BENCH_STEP_MS", "0")) / 1e3  # the stub core's floor per step
# the floor of a step no decode graph takes (default: STEP_S): on the device hosts an eager step costs ~6x a
# graph replay (~33 against ~5 ms at 256 rows, docs/benchmarks.md session 26), which a served load feels
EAGER_S = float(os.environ.get("CIPHERLM_BENCH_EAGER_STEP_MS", "0")) / 1e3 or STEP_S
HIDDEN_VOCAB = 49152      # SmolLM2's: prompt ids must fit the (tiny) embedding
WORD_IDS = range(600, 4600)  # the stub's sampled tokens: ordinary BPE pieces of SmolLM2's vocabulary


def stub_parts():
    """EngineParts whose executor runs no model (built in the core process)."""
    if os.environ.get("CIPHERLM_BENCH_BLOCKING_SEND"):  # the A/B's "before": the core's sends block
        from engine import engine_core

        init = engine_core._Outbox.__init__

        def blocking(self, conn) -> None:
            init(self, conn)
            self._sock = None

        engine_core._Outbox.__init__ = blocking
    import torch

    from bench.engine_host_cpu import StubExecutor, StubRunner
    from engine.model_runner import LaunchedStep
    from engine.parts import EngineParts

    class WordRunner(StubRunner):
        """The stub runner sampling ordinary word tokens (a different one per row and step) without logits:
        an argmax over thousands of columns per row would cost the core more than the engine's host work."""

        def __init__(self, *a) -> None:
            super().__init__(*a)
            n = self.config.max_num_seqs + 64
            self._ids = [(torch.arange(n) * 7 + s * 13) % len(WORD_IDS) + WORD_IDS.start for s in range(16)]
            self._step, self._next = 0, 0.0

        def _logits(self, n: int) -> torch.Tensor:
            return torch.zeros(n, 1)  # the synchronous path's (rare here) logits: token 0

        def launch(self, sched, prev):
            key = self._graph_for(sched.scheduled)
            if STEP_S:  # a GPU's step time: the core waits for the device as it would in resolve
                now = time.perf_counter()
                time.sleep(max(0.0, self._next - now))
                self._next = max(now, self._next) + (STEP_S if key is not None else EAGER_S)
            if key is not None:
                _, sampling = self._run_graph(sched.scheduled, key[0], 0, prev)
            else:
                sampling = self.prepare(sched, prev).sampling
            self._step += 1
            sampled = self._sampled[:len(sampling)]
            sampled.copy_(self._ids[self._step % 16][:len(sampling)])
            return LaunchedStep(sampling, sampled.clone(), None)

    class WordExecutor(StubExecutor):
        def __init__(self, config, max_model_len: int, num_blocks: int) -> None:
            super().__init__(config, max_model_len, num_blocks)
            self.runner = WordRunner(config, max_model_len, num_blocks)

    return EngineParts(executor=lambda model, conf, max_len: WordExecutor(conf, max_len, 20_000))


def serve(config_path: str, tok: str, engine_set: list[str]) -> None:
    """The server process: the app with a stub-core ProcessAsyncLLM, under uvicorn."""
    import tomllib
    import uvicorn

    import server.app as app_mod
    from engine.config import ModelConfig
    from engine.core_client import ProcessAsyncLLM
    from engine.engine_config import EngineConfig
    from engine.model import LlamaForCausalLM
    from engine.tokenizer import Tokenizer
    from server.settings import Settings

    settings = Settings.load(Path(config_path))
    extra = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (s.split("=", 1) for s in engine_set)}
    cfg = ModelConfig(model_type="llama", vocab_size=HIDDEN_VOCAB, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    # the GPU defaults that shape the host's work: the overlapped loop, the start-up freeze
    conf = EngineConfig(**({"device": "cpu", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                            "max_model_len": 4096, "async_scheduling": True, "gc_freeze": True} | extra))

    def build_engine(s):
        llm = ProcessAsyncLLM(LlamaForCausalLM(cfg), conf, Tokenizer.from_folder(tok), parts=stub_parts)
        llm.load_coalescing = s.stream_coalesce_streams
        return llm

    app_mod.build_engine = build_engine
    if os.environ.get("CIPHERLM_BENCH_STARLETTE_STREAM"):  # the A/B's "before": Starlette's task-group body
        from starlette.responses import StreamingResponse

        from server.routers import openai as openai_mod

        async def starlette_body(self, receive, send, scope={"asgi": {"spec_version": "2.3"}}):  # noqa: B006
            await StreamingResponse.__call__(self, {"type": "http", **scope}, receive, send)

        openai_mod._GuardedStream._stream_until_disconnect = starlette_body
    app = app_mod.create_app(settings)
    prof_path = os.environ.get("CIPHERLM_BENCH_CPROFILE")  # the API process under cProfile, dumped at exit
    if prof_path:
        import cProfile
        import signal

        prof = cProfile.Profile(time.process_time)  # CPU time: a busy box's waits stay out
        import gc

        gc_time = {"t": 0.0, "n": [0, 0, 0], "t0": 0.0}

        def gc_cb(phase, info):  # collector passes and their CPU time, reported with the profile
            if phase == "start":
                gc_time["t0"] = time.process_time()
            else:
                gc_time["t"] += time.process_time() - gc_time["t0"]
                gc_time["n"][info["generation"]] += 1

        gc.callbacks.append(gc_cb)

        def dump(*_) -> None:  # after the server returns (or a plain uvicorn re-raising SIGTERM): dump, leave
            prof.disable()
            prof.dump_stats(prof_path)
            Path(prof_path + ".gc").write_text(json.dumps(gc_time))
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
        prof.enable()
    from server.cli_serve import _server_class  # the server `cipherlm serve` runs (drain, gc_freeze)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    _server_class()(config, app.state.lifecycle, settings.drain_timeout_s, settings.gc_freeze).run()
    if prof_path:  # the draining server returns after SIGTERM
        dump()


def start(workdir: Path, tok: str, server_set: list[str], engine_set: list[str], env: dict[str, str]):
    from bench.serve_bench import bench_tenant, launch
    from server.local_server import free_port
    from server.tenants import generate_api_key

    key, port = generate_api_key(), free_port()
    path = workdir / "settings.toml"
    path.write_text(f'host = "127.0.0.1"\nport = {port}\nengine_process = true\n'
                    + "".join(f"{s}\n" for s in server_set) + bench_tenant(key))
    cmd = [sys.executable, "-m", "bench.serve_api_cpu", "--serve", str(path), "--tok", tok]
    cmd += [a for s in engine_set for a in ("--engine-set", s)]
    return launch(cmd, workdir, port, 120, 0.3, env), f"http://127.0.0.1:{port}", key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--tok", required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--engine-set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V,...",
                    help="a server variant: label, then server settings (engine.K=V: the engine's; env.K=V: "
                         "the server process's environment)")
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tok, args.engine_set)
        return
    from bench.serve_bench import bench, markdown

    variants = []
    for v in args.variant or ["default:"]:
        label, _, sets = v.partition(":")
        items = [s for s in sets.split(",") if s]
        variants.append((label, [s for s in items if not s.startswith(("engine.", "env."))],
                         [s[len("engine."):] for s in items if s.startswith("engine.")],
                         dict(s[len("env."):].split("=", 1) for s in items if s.startswith("env."))))
    bargs = argparse.Namespace(users=[args.users], request_rate=float("inf"), duration=args.duration,
                               input_len=args.input_len, output_len=args.output_len, timeout=300.0, seed=0,
                               clients=args.clients)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cipherlm-api-") as tmp:
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for label, server_set, engine_set, env in order:
                proc, url, key = start(Path(tmp), args.tok, server_set, engine_set, env)
                try:
                    row = asyncio.run(bench(bargs, url, key, proc.pid))[0]
                finally:
                    proc.terminate()
                    proc.wait(60)
                rows.append(row | {"engine": f"{label} r{r + 1}"})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    print(markdown(rows))


if __name__ == "__main__":
    main()
