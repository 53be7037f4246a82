"""``cipherlm serve``: run the HTTP server (uvicorn) on a model.

With no ``--config`` (and no ``$CIPHERLM_CONFIG``), the settings file is
``$CIPHERLM_HOME/server/settings.toml``; on first run a demo file is written there with one plaintext
tenant and one encrypted tenant, and their freshly generated API keys are printed **once** (the file
keeps only their SHA-256). SIGTERM (or Ctrl-C) drains: ``/health/ready`` turns 503, new requests (and new
encrypted sessions and key uploads) get 503, in-flight requests may finish within ``drain_timeout_s``; a
stream still running then ends with an error event (``server_shutdown``), the final signed audit
checkpoint is written and the process exits, about two seconds after the window; a second signal exits now.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

DEMO_TEMPLATE = """\
# cipherlm demo settings, written by `cipherlm serve` on first run.
# API keys were printed once; only their SHA-256 is stored here. Reference: docs/operator-guide.md
server_secret = "{secret}"   # derives per-tenant prefix-cache salts; keep it private

[[tenants]]
id = "demo-plaintext"
api_key_hashes = ["{plain_hash}"]
privacy_mode = "plaintext"

[[tenants]]
id = "demo-encrypted"
api_key_hashes = ["{enc_hash}"]
privacy_mode = "encrypted"
fallback = "never"            # "non_sensitive": allow plaintext requests marked non-sensitive
"""


def default_settings_path() -> Path:
    """``$CIPHERLM_HOME/server/settings.toml``."""
    from engine.default_model import cipherlm_home

    return cipherlm_home() / "server" / "settings.toml"


def write_demo_settings(path: Path) -> dict[str, str]:
    """Write the demo settings file (mode 0600); return {tenant id: API key} (show once, never stored)."""
    from server.tenants import generate_api_key, hash_api_key

    keys = {"demo-plaintext": generate_api_key(), "demo-encrypted": generate_api_key()}
    text = DEMO_TEMPLATE.format(secret=secrets.token_urlsafe(32),
                                plain_hash=hash_api_key(keys["demo-plaintext"]),
                                enc_hash=hash_api_key(keys["demo-encrypted"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return keys


def _settings_path(args: argparse.Namespace) -> Path:
    if args.config:
        return Path(args.config)
    if os.environ.get("CIPHERLM_CONFIG"):
        return Path(os.environ["CIPHERLM_CONFIG"])
    path = default_settings_path()
    if not path.exists():
        keys = write_demo_settings(path)
        print(f"cipherlm: wrote demo settings to {path}", flush=True)
        print("cipherlm: API keys (shown ONCE, only their hashes are stored):", flush=True)
        for tenant, key in keys.items():
            print(f"  {tenant:16s} {key}", flush=True)
    return path


def load_settings(args: argparse.Namespace):
    """The settings for this run: the file (or the demo file) plus command-line overrides."""
    from server.settings import Settings

    path = _settings_path(args)
    given = (("host", args.host), ("port", args.port), ("model", args.model))
    overrides = {k: v for k, v in given if v is not None}
    settings = Settings.load(path, **overrides)
    if getattr(args, "cluster", None):
        settings = with_cluster(settings, args.cluster)
    if getattr(args, "tensor_parallel", None):
        settings = with_tensor_parallel(settings, args.tensor_parallel)
    if getattr(args, "kv_cache_dtype", None):
        settings = with_kv_cache_dtype(settings, args.kv_cache_dtype)
    check_engine_settings(settings)
    print(f"cipherlm: settings {path} ({len(settings.tenants)} tenants)", flush=True)
    return settings


def with_cluster(settings, address: str):
    """``--cluster ADDRESS``: the encrypted workers become Ray actors of that cluster (``local``: a Ray head
    this server starts on 127.0.0.1)."""
    ray = {**settings.private.ray.model_dump(), "address": None if address == "local" else address}
    private = settings.private.model_copy(update={"backend": "ray", "ray": type(settings.private.ray)(**ray)})
    return settings.model_copy(update={"private": private})


def with_tensor_parallel(settings, size: int):
    """``--tensor-parallel N``: the engine splits the model over N ranks (``engine.distributed``); an N
    that does not divide the model's heads is refused here, before the server starts."""
    from engine.errors import ParallelConfigError

    engine = {**settings.engine, "tensor_parallel_size": size}
    model_cfg = _model_config(settings.model)
    if model_cfg is not None:
        from engine.tp_linear import check_tensor_parallel

        check_tensor_parallel(model_cfg, size)
    elif size < 1:
        raise ParallelConfigError(f"--tensor-parallel must be >= 1, got {size}")
    return settings.model_copy(update={"engine": engine})


def with_kv_cache_dtype(settings, kv_cache_dtype: str):
    """``--kv-cache-dtype auto|fp8_e4m3``: what this deployment's KV pools hold (``EngineConfig.kv_cache_dtype``);
    a combination the engine refuses (an unknown dtype, fp8 with tensor parallelism) stops the server before
    it starts (ValueError, from :func:`check_engine_settings`)."""
    settings = settings.model_copy(update={"engine": {**settings.engine, "kv_cache_dtype": kv_cache_dtype}})
    check_engine_settings(settings)
    return settings


def check_engine_settings(settings) -> None:
    """The ``[engine]`` table as the engine will take it: an unknown key (a typo, or a switch a release
    removed) or a value the engine refuses stops the server before it starts, as a ValueError."""
    from engine.engine_config import EngineConfig

    try:
        EngineConfig(**settings.engine)
    except TypeError as exc:  # an unknown [engine] key
        raise ValueError(f"[engine] settings: {exc}") from exc


def _model_config(model: str | None):
    """The served model's config, read without its weights (None when the model is not there yet)."""
    from engine.config import ModelConfig

    if model is None:  # the default model, if pulled (the engine checks again once it has it)
        from engine.default_model import DEFAULT_MODEL_NAME, models_dir

        model = str(models_dir() / DEFAULT_MODEL_NAME)
    path = Path(model)
    if path.suffix == ".gguf":
        from engine.loader import gguf_config

        return gguf_config(path)
    return ModelConfig.from_file(path / "config.json") if (path / "config.json").exists() else None


def uvicorn_internals_fit(server) -> bool:
    """Whether ``server`` (a loaded uvicorn.Server) still has the start-up parts that
    ``DrainingServer._startup_accepting_all`` restates: the lifespan, the shared server state, the protocol
    class and its keywords, the start message. uvicorn offers no setting for the accept batch, so a release
    that renames one of them gets its own start-up back, with a warning, instead of a server that cannot start."""
    import inspect

    from uvicorn import config as uvicorn_config

    protocol = getattr(server.config, "http_protocol_class", None)
    if protocol is None or not hasattr(uvicorn_config, "STARTUP_FAILURE"):
        return False
    try:
        params = inspect.signature(protocol).parameters
    except (TypeError, ValueError):
        return False
    return ({"config", "server_state", "app_state", "_loop"} <= params.keys()
            and callable(getattr(getattr(server, "lifespan", None), "startup", None))
            and hasattr(server, "server_state") and callable(getattr(server, "_log_started_message", None)))


#: after the drain window, how long uvicorn may still wait for responses to flush (the streams cut at
#: the deadline send their error event) before it cancels them and runs the app's shutdown
FLUSH_GRACE_S = 1.5


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn whose first SIGTERM/SIGINT drains before exiting: ready → 503, new work → 503, in-flight
        requests get ``drain_timeout_s``; then streams still running are cut with an error event and the
        app shuts down (final audit checkpoint). uvicorn's own graceful wait is only ``FLUSH_GRACE_S``:
        it must not wait a second drain window after ours."""

        def __init__(self, config: uvicorn.Config, lifecycle, drain_timeout_s: float,
                     gc_freeze: bool = False) -> None:
            super().__init__(config)
            self.lifecycle = lifecycle
            self.drain_timeout_s = drain_timeout_s
            self.drain_deadline: float | None = None
            self.gc_freeze = gc_freeze

        async def startup(self, sockets=None) -> None:
            config = self.config
            if sockets is not None or config.uds or config.fd is not None or config.is_ssl:
                await super().startup(sockets)  # the cases `cipherlm serve` does not use: uvicorn's own
            elif not uvicorn_internals_fit(self):
                print("cipherlm: warning: this uvicorn's start-up differs from the one `cipherlm serve` knows; "
                      "listening through uvicorn's own (one accept per loop turn under uvloop)",
                      file=sys.stderr, flush=True)
                await super().startup(sockets)
            else:
                await self._startup_accepting_all()
            if self.gc_freeze:  # Settings.gc_freeze: the start-up heap leaves every later full collection
                import gc

                gc.collect()
                gc.freeze()

        async def _startup_accepting_all(self) -> None:
            """uvicorn's start-up for a host and port, on a socket that accepts every waiting connection each
            loop turn (``server.accept``) where uvloop's accepts one."""
            from uvicorn.config import STARTUP_FAILURE

            from server.accept import BatchAcceptServer, listen

            await self.lifespan.startup()
            if self.lifespan.should_exit:
                sys.exit(STARTUP_FAILURE)
            config = self.config

            def create_protocol(_loop=None):
                return config.http_protocol_class(config=config, server_state=self.server_state,
                                                  app_state=self.lifespan.state, _loop=_loop)

            try:
                sockets = listen(config.host, config.port, config.backlog)
            except OSError as exc:  # the port is taken, the address is not ours: as uvicorn reports it
                print(f"cipherlm: error: {exc}", file=sys.stderr, flush=True)
                await self.lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)
            loop = asyncio.get_running_loop()
            self.servers = [BatchAcceptServer(loop, sock, create_protocol) for sock in sockets]
            self._log_started_message(sockets)
            self.started = True

        def handle_exit(self, sig, frame) -> None:
            if self.drain_deadline is None:
                self.lifecycle.draining = True
                self.drain_deadline = time.monotonic() + self.drain_timeout_s
                print(f"cipherlm: draining ({self.lifecycle.in_flight} in flight, "
                      f"up to {self.drain_timeout_s:.0f} s)", file=sys.stderr, flush=True)
            else:
                super().handle_exit(sig, frame)  # second signal: exit now

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if self.drain_deadline is None:
                return False
            if self.lifecycle.in_flight == 0:
                return True
            if time.monotonic() >= self.drain_deadline:
                print(f"cipherlm: drain window over; ending {self.lifecycle.in_flight} request(s)",
                      file=sys.stderr, flush=True)
                self.lifecycle.cut()
                return True
            return False

    return DrainingServer


def serve(args: argparse.Namespace) -> int:
    """Build the app and run uvicorn until drained."""
    from engine.threads import configure

    configure(args.threads, verbose=True)  # before torch loads: OpenMP reads its environment once
    import uvicorn

    from server.app import create_app

    try:
        settings = load_settings(args)
    except ValueError as exc:  # ParallelConfigError and the like: say what is wrong, no traceback
        print(f"cipherlm: error: {exc}", file=sys.stderr, flush=True)
        return 2
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_GRACE_S)
    server = _server_class()(config, app.state.lifecycle, settings.drain_timeout_s, settings.gc_freeze)
    print(f"cipherlm: serving on http://{settings.host}:{settings.port}", flush=True)
    server.run()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cipherlm serve``."""
    from server.cli import add_threads_option, plain_help

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="settings TOML file (default: the demo file, written on first run)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--model", help="model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cluster", metavar="ADDRESS",
                   help="run the encrypted workers as Ray actors on this cluster (host:6379 or "
                        "ray://host:10001; 'local': a Ray head on 127.0.0.1). Needs cipherlm[ray]")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    p.add_argument("--tensor-parallel", type=int, metavar="N",
                   help="split the model over N ranks (GPUs cuda:0..N-1, or CPU processes); N must divide "
                        "the query and KV heads (default 1)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8"],
                   help="what the KV cache holds: the model dtype (auto, default) or fp8 e4m3 with per-head "
                        "scales (half the bytes of bf16 per token; docs/engine.md, 'FP8 KV cache')")
    add_threads_option(p)
    p.set_defaults(func=serve)


def main(argv: list[str] | None = None) -> int:
    """``python -m server.cli_serve ...``: the serve command alone (no other CLI group is imported)."""
    parser = argparse.ArgumentParser(prog="cipherlm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
