"""``cipherlm demo``: one prompt answered by a plaintext tenant and by an encrypted tenant, side by side.

The command writes a throw-away settings file (one plaintext tenant, one encrypted tenant, fresh API
keys, state in a temporary folder), starts ``cipherlm serve`` on the default model as a subprocess, waits
until it is ready, then streams the same prompt twice:

* **plaintext** — ``Client(...).completions.create(..., stream=True)``: the server sees the prompt;
* **encrypted** — the private runtime behind ``Client(privacy="encrypted")``: the client downloads the
  plan's bundle (verified by SHA-256), generates CKKS keys locally, registers only the public
  evaluation keys, runs the clear layers itself and sends each encrypted layer's input as ciphertext.

Each token is printed as it arrives with its latency (and, encrypted, the bytes sent and received for
it), followed by the one-time costs. The server is stopped with SIGTERM at the end. The encrypted path
costs seconds per token per encrypted layer on a small CPU: ``--layers 1`` keeps only the first
encrypted layer of the default plan for a quick look.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from server.local_server import exit_with_parent, free_port, stop_server, wait_ready

DEFAULT_PROMPT = "The capital of France is"
MAX_KEY_BYTES = 1 << 30  # the shipped plan's evaluation keys (N = 32768) are ~0.5 GB: over the 256 MiB default
READY_TIMEOUT_S = 900.0  # first run: the default model is pulled and the client bundle built


@dataclass
class DemoServer:
    """A running ``cipherlm serve`` subprocess and what a client needs to reach it."""

    url: str
    keys: dict[str, str]  # tenant id -> API key
    proc: subprocess.Popen
    root: Path
    log_path: Path


def plan_with_layers(layers: str, root: Path) -> Path | None:
    """None for ``all`` (the shipped plan); else a plan of the default plan's first N encrypted layers."""
    if layers == "all":
        return None
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    full = Plan.load(default_plan_path())
    n = int(layers)
    if not 1 <= n <= len(full.layers):
        raise ValueError(f"--layers must be 'all' or 1..{len(full.layers)}")
    if n == len(full.layers):
        return None
    plan = Plan(full.model_id, full.weights_sha256, tuple(full.layers[:n]), full.ckks,
                f"cipherlm demo: first {n} encrypted layer(s) of the default plan", full.calibration)
    return plan.save(root / f"demo-{n}-layer.plan.json")


def write_settings(root: Path, port: int, plan: Path | None, workers: int,
                   max_session_tokens: int = 512, offload: Path | None = None) -> tuple[Path, dict[str, str]]:
    """The demo settings file (mode 0600) in ``root``; returns (path, {tenant id: API key}). ``offload``: an
    offload plan whose server attention layers are ``plan``'s (the server runs their MLPs too)."""
    import secrets

    from server.tenants import generate_api_key, hash_api_key

    keys = {"demo-plaintext": generate_api_key(), "demo-encrypted": generate_api_key()}
    modes = {"demo-plaintext": "plaintext", "demo-encrypted": "encrypted"}
    tenants = "".join(f'[[tenants]]\nid = "{t}"\napi_key_hashes = ["{hash_api_key(k)}"]\n'
                      f'privacy_mode = "{modes[t]}"\n\n' for t, k in keys.items())
    plan_line = f'plan = "{plan}"\n' if plan is not None else ""
    if offload is not None:
        plan_line += f'offload_plan = "{offload}"\n'
    text = (f'server_secret = "{secrets.token_urlsafe(32)}"\nhost = "127.0.0.1"\nport = {port}\n\n{tenants}'
            f'[private]\nenabled = true\nworkers = {workers}\nstate_dir = "{root / "state"}"\n{plan_line}'
            f"max_session_tokens = {max_session_tokens}\nmax_key_bytes = {MAX_KEY_BYTES}\n")
    path = root / "settings.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path, keys


@contextlib.contextmanager
def running_server(root: Path, port: int | None, plan: Path | None, workers: int,
                   max_session_tokens: int = 512, offload: Path | None = None) -> Iterator[DemoServer]:
    """Start ``cipherlm serve`` with demo settings in ``root``; yield it ready; stop it on exit."""
    port = port or free_port()
    settings, keys = write_settings(root, port, plan, workers, max_session_tokens, offload)
    log_path = root / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli_serve", "--config", str(settings),
                             "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=exit_with_parent)
    # the server runs in its own session (a terminal's Ctrl-C reaches only us): a SIGTERM to this process
    # must still stop it, or its workers (several GB each) outlive us
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, READY_TIMEOUT_S, log_path)
        yield DemoServer(url, keys, proc, root, log_path)
    finally:
        stop_server(proc)
        log.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def client_timeout():
    """Generous read/write bounds: one encrypted step can take minutes on a loaded small CPU."""
    from client_sdk import Timeout

    return Timeout(connect=10, read=1800, write=1800, pool=10)


@dataclass
class Setup:
    """One-time costs of an encrypted-mode client (first use)."""

    manifest_s: float
    bundle_s: float
    bundle_bytes: int
    keys_s: float
    key_upload_bytes: int
    encrypted_layers: tuple[int, ...]


def prepare_private(client, cache_dir: Path):
    """The private runtime of ``client``, prepared step by step so each one-time cost is timed.

    Same steps as ``PrivateRuntime.prepare()``: manifest, bundle (download + SHA-256 check), local CKKS
    key generation and registration of the public evaluation keys.
    """
    from client_sdk._private import PrivateRuntime

    runtime = client._private = PrivateRuntime(client, key_id="demo", cache_dir=cache_dir)
    t0 = time.perf_counter()
    man = runtime.fetch_manifest()
    t1 = time.perf_counter()
    runtime.load_bundle(man)
    t2 = time.perf_counter()
    uploaded = runtime.register_keys(man)   # attention key set where needed, offload key set (N = 8192)
    t3 = time.perf_counter()
    runtime.manifest = man
    setup = Setup(t1 - t0, t2 - t1, man.bundle_size, t3 - t2, uploaded, runtime.layers)
    return runtime, setup


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _show(text: str) -> str:
    return repr(text)[1:-1] if text else "(end)"


def run_plaintext(server: DemoServer, prompt: str, max_tokens: int) -> str:
    """Stream the plaintext tenant's answer, one line per token; returns the text."""
    from client_sdk import Client

    print("\n== plaintext tenant (the server sees the prompt and the answer) ==", flush=True)
    text = []
    with Client(api_key=server.keys["demo-plaintext"], base_url=server.url, timeout=client_timeout()) as client:
        t0 = last = time.perf_counter()
        stream = client.completions.create(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            now = time.perf_counter()
            piece = chunk.choices[0].text
            text.append(piece)
            label = "first token" if i == 0 else "next token"
            print(f"  token {i + 1:3d}  {_show(piece):>16s}  {(now - last) * 1000:9.1f} ms  ({label})", flush=True)
            last = now
    print(f"  answer: {prompt}\u2192{''.join(text)!r}   ({time.perf_counter() - t0:.2f} s)", flush=True)
    return "".join(text)


def run_encrypted(server: DemoServer, prompt: str, max_tokens: int, cache_dir: Path) -> str:
    """Set up the private runtime (timed), then stream the encrypted tenant's answer; returns the text."""
    from client_sdk import Client, ProgressPrinter
    from engine.sampling_params import SamplingParams

    print("\n== encrypted tenant (the server sees only CKKS ciphertexts) ==", flush=True)
    # no hand-set timeouts: the SDK derives each encrypted step's wait from the server's plan
    with Client(api_key=server.keys["demo-encrypted"], base_url=server.url, privacy="encrypted",
                progress=ProgressPrinter(sys.stdout)) as client:
        runtime, setup = prepare_private(client, cache_dir)
        print(f"  one-time setup: manifest {setup.manifest_s:.2f} s; bundle {_mb(setup.bundle_bytes)} "
              f"downloaded and SHA-256 verified in {setup.bundle_s:.2f} s; CKKS keys generated locally and "
              f"public evaluation keys registered ({_mb(setup.key_upload_bytes)} uploaded) in "
              f"{setup.keys_s:.2f} s", flush=True)
        print(f"  encrypted layers: {list(setup.encrypted_layers)} of {runtime.model.config.num_hidden_layers}"
              " (all the other layers, the embedding and the head run on this machine)", flush=True)
        ids = runtime.tokenizer.encode(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        text = []
        t0 = last = time.perf_counter()
        for i, tok in enumerate(runtime.generate(ids, params)):
            now = time.perf_counter()
            text.append(tok.text)
            s = tok.stats
            label = f"prefill of {len(ids)} prompt tokens + first token" if i == 0 else "next token"
            print(f"  token {i + 1:3d}  {_show(tok.text):>16s}  {now - last:8.2f} s   up {_mb(s.bytes_up):>9s}"
                  f"  down {_mb(s.bytes_down):>9s}  ({s.steps} encrypted step(s), {s.seconds:.2f} s on the "
                  f"server; {label})", flush=True)
            last = now
    print(f"  answer: {prompt}\u2192{''.join(text)!r}   ({time.perf_counter() - t0:.2f} s after setup)", flush=True)
    return "".join(text)


def demo(args: argparse.Namespace) -> int:
    """Start a server, answer the prompt with both tenants, stop the server."""
    from engine.threads import configure

    # this process runs the client's clear layers; the server subprocess inherits the choice through
    # $OMP_NUM_THREADS (engine.threads reads it there)
    configure(args.threads, verbose=True)
    with tempfile.TemporaryDirectory(prefix="cipherlm-demo-") as tmp:
        root = Path(tmp)
        plan = plan_with_layers(args.layers, root)
        workers = 1  # one session at a time; a worker holding the N=32768 keys needs several GB of memory
        print(f"cipherlm demo: starting `cipherlm serve` on the default model (state in {root}); "
              "the first run pulls the model and builds the client bundle, which takes a while", flush=True)
        t0 = time.perf_counter()
        with running_server(root, args.port, plan, workers) as server:
            print(f"cipherlm demo: server ready at {server.url} in {time.perf_counter() - t0:.1f} s "
                  f"(tenants: demo-plaintext, demo-encrypted)", flush=True)
            print(f"cipherlm demo: prompt {args.prompt!r}, {args.max_tokens} tokens, greedy", flush=True)
            run_plaintext(server, args.prompt, args.max_tokens)
            run_encrypted(server, args.prompt, args.max_tokens, root / "client")
            print("\ncipherlm demo: stopping the server (SIGTERM)", flush=True)
        print(f"cipherlm demo: server stopped (exit status {server.proc.returncode})", flush=True)
    return 0


def _layers_arg(value: str) -> str:
    if value == "all" or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError("expected 'all' or a positive number of layers")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cipherlm demo``."""
    from server.cli import add_threads_option, plain_help

    p = subparsers.add_parser("demo", help="the same prompt answered by a plaintext and an encrypted tenant",
                              description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"raw completion prompt (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens to generate (default 4)")
    p.add_argument("--layers", default="all", type=_layers_arg,
                   help="'all' (the default plan) or N: only the plan's first N encrypted layers (faster)")
    p.add_argument("--port", type=int, help="server port (default: a free one)")
    add_threads_option(p)
    p.set_defaults(func=demo)
