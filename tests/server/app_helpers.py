"""Shared pieces of the server tests: a tiny random-weight model with the real SmolLM2 tokenizer,
settings with one tenant of each kind, and a started engine (the real AsyncLLM, no mocks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.default_model import default_model_dir
from engine.loader import save_hf_folder
from engine.model import LlamaForCausalLM
from server.local_server import exit_with_parent, free_port, wait_ready
from server.settings import LimitSettings, Settings, TenantSettings
from server.tenants import hash_api_key

KEYS = {"plain": "clm-test-plain", "plain2": "clm-test-plain2", "enc": "clm-test-enc",
        "enc-fallback": "clm-test-encfb", "limited": "clm-test-limited"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model_dir(folder: Path, seed: int = 0, max_len: int = 4096) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer files, saved as a HF folder."""
    src = default_model_dir()
    ref = ModelConfig.from_file(src / "config.json")
    cfg = ModelConfig(vocab_size=ref.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=True, max_position_embeddings=max_len,
                      bos_token_id=ref.bos_token_id, eos_token_id=ref.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    save_hf_folder(model, folder)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


def tenants() -> list[TenantSettings]:
    """One tenant of each kind the tests need."""
    return [
        TenantSettings(id="plain", api_key_hashes=[hash_api_key(KEYS["plain"])]),
        TenantSettings(id="plain2", api_key_hashes=[hash_api_key(KEYS["plain2"])]),
        TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEYS["enc"])], privacy_mode="encrypted"),
        TenantSettings(id="enc-fallback", api_key_hashes=[hash_api_key(KEYS["enc-fallback"])],
                       privacy_mode="encrypted", fallback="non_sensitive"),
        TenantSettings(id="limited", api_key_hashes=[hash_api_key(KEYS["limited"])],
                       limits=LimitSettings(requests_per_minute=2, tokens_per_minute=400, max_concurrent=1,
                                            max_tokens=64)),
    ]


def make_settings(model_dir: Path | None = None, **overrides) -> Settings:
    """Settings with the test tenants (no TOML, no environment)."""
    # engine_process: apps that build their own engine keep it in a thread (no process spawn per test);
    # the live `cipherlm serve` fixture and tests/server/test_engine_process.py run the core process
    fields = dict(model=str(model_dir) if model_dir else None, served_model_name="tiny",
                  server_secret="test-secret", tenants=tenants(), engine_process=False)
    return Settings(**{**fields, **overrides})


def auth(name: str) -> dict[str, str]:
    """The Authorization header of test tenant ``name``."""
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model folder (built once per session)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """(model, tokenizer) loaded once per session."""
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    return load_model(tiny_model_dir), Tokenizer.from_folder(tiny_model_dir)


@pytest.fixture
async def engine(tiny_loaded):
    """A started AsyncLLM on the tiny model (one per test: it binds to the test's event loop)."""
    from engine.async_llm import AsyncLLM
    from engine.engine_config import EngineConfig

    model, tok = tiny_loaded
    # CIPHERLM_TEST_ENGINE=process runs every test of this fixture against the engine-core process
    cls = AsyncLLM
    if os.environ.get("CIPHERLM_TEST_ENGINE") == "process":
        from engine.core_client import ProcessAsyncLLM as cls
    llm = cls.from_model(model, tok, EngineConfig(device="cpu", num_kv_blocks=256, block_size=16,
                                                  max_waiting=64))
    await llm.start()
    yield llm
    await llm.shutdown()


# --- a real `cipherlm serve` process on loopback ----------------------------------------------------


def write_settings_toml(path: Path, model_dir: Path, port: int, drain_timeout_s: float = 30.0,
                        extra: str = "") -> Path:
    """A settings file with the test tenants (TOML written by hand: only hashes, never keys); ``extra``
    is appended (e.g. a ``[private]`` table)."""
    lines = [f'model = "{model_dir}"', 'served_model_name = "tiny"', 'server_secret = "test-secret"',
             'host = "127.0.0.1"', f"port = {port}", f"drain_timeout_s = {drain_timeout_s}", "",
             "[engine]", 'device = "cpu"', "num_kv_blocks = 512", ""]
    for t in tenants():
        lines += ["[[tenants]]", f'id = "{t.id}"', f"api_key_hashes = {t.api_key_hashes!r}".replace("'", '"'),
                  f'privacy_mode = "{t.privacy_mode.value}"', f'fallback = "{t.fallback.value}"']
        if t.limits is not None:
            lines.append("[tenants.limits]")
            # 0 switches a limit off (TOML has no null; an omitted key would mean the default)
            lines += [f"{k} = {0 if v is None else v}" for k, v in t.limits.model_dump().items()]
        lines.append("")
    path.write_text("\n".join(lines) + extra)
    return path


class LiveServer:
    """``cipherlm serve --config ...`` as a subprocess; :meth:`start` waits for /health/ready."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self, timeout_s: float = 180.0) -> LiveServer:
        import os
        import sys

        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self._log_fh = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(self.config),
                                      "--log-level", "warning"], stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=exit_with_parent)
        try:
            wait_ready(self.proc, self.url, timeout_s, self.log, poll_s=0.3)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait; kill if it does not exit. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_fh.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def live_server(tiny_model_dir, tmp_path_factory):
    """One `cipherlm serve` process for the session (tiny model, the test tenants)."""
    tmp = tmp_path_factory.mktemp("live-server")
    port = free_port()
    server = LiveServer(write_settings_toml(tmp / "settings.toml", tiny_model_dir, port), port, tmp / "server.log")
    server.start()
    yield server
    server.stop()

