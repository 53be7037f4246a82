"""Native CPU kernels (C++, AVX2/FMA/F16C): few-row products over GGUF Q4_1 / Q8_0 blocks and fp32 weights.

The source (``gemv_q.cpp`` beside this file) is compiled with the system C++ compiler (``$CXX`` or ``g++``)
at first use and cached under ``$CIPHERLM_NATIVE_CACHE`` (default ``~/.cache/cipherlm/native/``), one
shared object per hash of the source, torch version and compiler; a later process loads it in
milliseconds (the build takes ~20 s on the 2-core CI box). No ninja, no build step at install time.

:func:`available` is False — and callers keep their torch path — where the CPU lacks AVX2/FMA/F16C, no
compiler is found, the build fails, or ``CIPHERLM_NATIVE=0``; the reason is in :func:`unavailable_reason`.

Launchers (fp32 ``x [M, K]`` in, fp32 ``[M, N]`` out; the weight's layout as in the source's header):
:func:`q4_1_mm`, :func:`q8_0_mm`, :func:`f32_mm` (:func:`q4_1_linear` / :func:`q8_0_linear`: the same
product bound to one weight, checked once); and :func:`decode_step`, a whole batch-1 decode step over
those products (``engine.cpu_decode``). The quantized ones have a pure-torch reference (``*_ref``) that the
tests compare it with: the quantized kernels quantize the activations per block of 32 to int8 as
llama.cpp does (:func:`quantize_q8`), so the reference is the dequantized weight times those dequantized
activations, equal to float rounding.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.errors import KernelInputError

_SOURCE = Path(__file__).with_name("gemv_q.cpp")
_NEEDED_FLAGS = ("avx2", "fma", "f16c")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    return Path(os.environ.get("CIPHERLM_NATIVE_CACHE", Path.home() / ".cache" / "cipherlm" / "native"))


def _compile_cmd(cxx: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = library_paths()[0]
    return [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx2", "-mfma", "-mf16c",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()], str(_SOURCE),
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(out)]


def _build() -> str | None:
    """Compile (or find cached) and load the kernels; None when loaded, else why not."""
    if os.environ.get("CIPHERLM_NATIVE", "1") == "0":
        return "disabled by CIPHERLM_NATIVE=0"
    missing = [f for f in _NEEDED_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return "no C++ compiler (set CXX or install g++)"
    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + cxx.encode()).hexdigest()[:16]
    so = _cache_dir() / f"gemv_q-{key}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            tmp_so = Path(tmp) / so.name
            res = subprocess.run(_compile_cmd(cxx, tmp_so), capture_output=True, text=True)
            if res.returncode != 0:
                return f"build failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"
            os.replace(tmp_so, so)  # atomic: concurrent builders each rename a whole file
    torch.ops.load_library(str(so))
    return None


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    with _lock:
        if "reason" not in _state:
            try:
                _state["reason"] = _build()
            except (OSError, RuntimeError) as exc:
                _state["reason"] = f"load failed: {exc}"
    return _state["reason"] is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    available()
    return _state["reason"]


def _operands(*operands: tuple[str, torch.Tensor, torch.dtype, tuple[int, ...]]) -> None:
    """Check each weight operand (name, tensor, dtype, shape) here: the C++ checks raise too, but an exception
    thrown out of the extension has crashed the process on one machine (a CUDA torch build, inside pytest)."""
    for name, t, dtype, shape in operands:
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise KernelInputError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
                                   f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [M, K] as the kernels take it (fp32, contiguous)."""
    if x.dim() != 2 or x.shape[1] != k:
        raise KernelInputError(f"x is {tuple(x.shape)}: it needs 2 dims and the weight's {k} columns")
    return x.float().contiguous()


def _blocks(k: int) -> int:
    if k % 32:
        raise KernelInputError(f"K = {k} is not a whole number of 32-column blocks")
    return k // 32


def q4_1_linear(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product ``x [M, K] -> x @ W.T [M, N]`` fp32 over a Q4_1 weight (qs uint8 [N, K/2], d/m fp16
    [N, K/32]), the weight checked once here and each x per call (a layer's decode rows: ~0.3 us, not ~4)."""
    n, k = qs.shape[0], 2 * qs.shape[-1]
    g = (n, _blocks(k))
    _operands(("qs", qs, torch.uint8, (n, k // 2)), ("d", d, torch.float16, g), ("m", m, torch.float16, g))
    op = torch.ops.cipherlm_cpu.q4_1_mm
    return lambda x: op(_rows(x, k), qs, d, m)


def q8_0_linear(qs: torch.Tensor, d: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """As :func:`q4_1_linear` over a Q8_0 weight (qs int8 [N, K], d fp16 [N, K/32])."""
    n, k = qs.shape[0], qs.shape[-1]
    _operands(("qs", qs, torch.int8, (n, k)), ("d", d, torch.float16, (n, _blocks(k))))
    op = torch.ops.cipherlm_cpu.q8_0_mm
    return lambda x: op(_rows(x, k), qs, d)


def q4_1_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ Q4_1 weight (qs uint8 [N, K/2], d/m fp16 [N, K/32]).T -> [M, N] fp32."""
    return q4_1_linear(qs, d, m)(x)


def q8_0_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ Q8_0 weight (qs int8 [N, K], d fp16 [N, K/32]).T -> [M, N] fp32."""
    return q8_0_linear(qs, d)(x)


def f32_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] fp32, for few rows M (decode): each weight row streamed once."""
    if w.dim() != 2:
        raise KernelInputError(f"w must be [N, K], got shape {tuple(w.shape)}")
    _operands(("w", w, torch.float32, tuple(w.shape)))
    return torch.ops.cipherlm_cpu.f32_mm(_rows(x, w.shape[1]), w)


def decode_step(h: torch.Tensor, weights: list[torch.Tensor], num_layers: int, num_heads: int,
                num_kv_heads: int, pos: int, block_table: list[int], cos: torch.Tensor, sin: torch.Tensor,
                eps: float) -> None:
    """Every decoder layer of one token at position ``pos``, in place on ``h [1, hidden]`` fp32.

    ``weights`` per layer: ``ln1, ln2, k_cache, v_cache`` (the paged pools ``[NB, BS, Hkv, D]`` fp32; the
    token's K/V are stored at its slot through ``block_table``), then the q/k/v, o, gate/up and down linears,
    each ``[w]`` fp32 ``[N, K]``, ``[qs, d, m]`` (Q4_1, as :func:`q4_1_mm`) or ``[qs, d]`` (Q8_0). ``cos`` /
    ``sin`` ``[positions, D]``: RoPE's tables (row ``pos`` is used). See ``engine.cpu_decode``."""
    torch.ops.cipherlm_cpu.decode_step(h, weights, num_layers, num_heads, num_kv_heads, pos, block_table,
                                       cos, sin, eps)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization: (qx int8 [M, K], dx [M, K/32], sx = dx * sum(qx) [M, K/32])."""
    _blocks(x.shape[-1])
    qx, dx, sx = torch.ops.cipherlm_cpu.quantize_q8(_rows(x, x.shape[-1]))
    return qx, dx, sx


# ---- layouts and torch references -----------------------------------------------------------------

def q4_1_from_u(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] in 0..15 -> the kernel's qs [N, K/2] (per block: byte j = u[j] | u[j + 16] << 4)."""
    n, k = u.shape
    b = u.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def q4_1_to_u(qs: torch.Tensor) -> torch.Tensor:
    """The kernel's qs [N, K/2] -> u [N, K] uint8 (inverse of :func:`q4_1_from_u`)."""
    n, half = qs.shape
    b = qs.reshape(n, half // 16, 16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, 2 * half)


def _dequant_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qx, dx, _ = quantize_q8(x)
    m, k = qx.shape
    return (qx.float().view(m, k // 32, 32) * dx[..., None]).view(m, k), qx


def q4_1_mm_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Dequantized weight times the kernel's dequantized int8 activations (float64 sums)."""
    n, k = qs.shape[0], qs.shape[1] * 2
    w = q4_1_to_u(qs).double().view(n, k // 32, 32) * d.double()[..., None] + m.double()[..., None]
    xd, _ = _dequant_x(x)
    return (xd.double() @ w.view(n, k).T).float()


def q8_0_mm_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = qs.shape
    w = qs.double().view(n, k // 32, 32) * d.double()[..., None]
    xd, _ = _dequant_x(x)
    return (xd.double() @ w.view(n, k).T).float()
