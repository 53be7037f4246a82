"""What one streamed completion costs the API process apart from its tokens, on the CPU.

At 256 streamed users of 128-token outputs the users' requests finish together and the next 256 arrive at
once, so the API's per-request work (middleware, routing, FastAPI's dependencies and body model, the
checks, tokenizing, submitting) comes in bursts (docs/benchmarks.md, "Serving at 256 users"). This drives
the real app (``server.app.create_app``, the real tokenizer) straight through ASGI, without uvicorn or
sockets, against an engine that answers every request with one finished token, and reports the CPU time
per request (``time.process_time``), median of ``--rounds`` rounds of ``--requests`` each:

    python bench/serve_request_cpu.py --tok DIR [--requests 2000] [--rounds 5]

Run it with another tree first on ``PYTHONPATH`` to compare trees on the same box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


class _OneToken:
    """An engine stream that yields one finished output."""

    def __init__(self, out) -> None:
        self._out = out

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._out is None:
            raise StopAsyncIteration
        out, self._out = self._out, None
        return out

    async def aclose(self) -> None:
        self._out = None


class FakeEngine:
    """The parts of ``ProcessAsyncLLM`` the plaintext endpoints use; every request finishes at once."""

    def __init__(self, tok) -> None:
        from engine.config import ModelConfig

        self.tokenizer = tok
        self.model_config = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=8, intermediate_size=8,
                                        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                        head_dim=8, max_position_embeddings=4096, tie_word_embeddings=True)
        self.max_model_len = 4096
        self.stats = None

    def generate(self, prompt, params, request_id, *, cache_salt=None, priority=0):
        from engine.outputs import CompletionOutput, RequestOutput

        comp = CompletionOutput(0, [600], "the", "the", [600], None, "length", None)
        return _OneToken(RequestOutput(request_id, list(prompt), [comp], True, 0, None))

    async def abort(self, request_id: str) -> None:
        return None


async def drive(app, body: bytes, headers: list, n: int) -> float:
    """CPU seconds for ``n`` streamed requests, one after another, through the ASGI app."""
    sent: list = []

    async def send(message) -> None:
        sent.append(message)

    def receive_for():
        done = {"body": False}

        async def receive():
            if not done["body"]:
                done["body"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client never leaves
            return {"type": "http.disconnect"}

        return receive

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "state": {}}
    t0 = time.process_time()
    for _ in range(n):
        sent.clear()
        await app(dict(scope, state={}), receive_for(), send)
        status = sent[0]["status"]
        if status != 200:
            raise SystemExit(f"status {status}: {sent[1:]}")
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tok", required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import gc

    from engine.tokenizer import Tokenizer
    from server.app import create_app
    from server.settings import Settings
    from server.tenants import generate_api_key

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.serve_bench import bench_tenant

    key = generate_api_key()
    import tomllib

    settings = Settings.model_validate(tomllib.loads(bench_tenant(key)))
    app = create_app(settings, FakeEngine(Tokenizer.from_folder(args.tok)))
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
             "near the old harbor lights ").split()
    prompt = " ".join(words[i % len(words)] for i in range(100))  # serve_bench's 100-word prompts
    body = json.dumps({"model": None, "prompt": prompt, "max_tokens": 128, "temperature": 0.0, "stream": True,
                       "ignore_eos": True}).encode()
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"authorization", f"Bearer {key}".encode()), (b"content-length", str(len(body)).encode())]
    gc.collect()
    gc.freeze()  # as `cipherlm serve` does after start-up

    async def run() -> list[float]:
        await drive(app, body, headers, 200)  # warm-up
        return [await drive(app, body, headers, args.requests) for _ in range(args.rounds)]

    per = [t / args.requests * 1e6 for t in asyncio.run(run())]
    print(f"{args.label} µs CPU per streamed request: median {statistics.median(per):.0f} "
          f"(rounds {', '.join(f'{p:.0f}' for p in per)})")


if __name__ == "__main__":
    main()
