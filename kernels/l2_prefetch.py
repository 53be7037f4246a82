"""Pull weight bytes into the GPU's L2 ahead of the kernel that reads them (Hopper's bulk L2 prefetch).

At batch 1 a decode layer is ~10 kernels of which only the GEMVs move many bytes; while the small ones run
(norms, RoPE + K/V store, the attention's two launches: ~11 µs of a Qwen2.5-0.5B layer's ~24 on an H100) the
memory is nearly idle (docs/benchmarks.md, "Session 24's last device calls"). A prefetch launched on a side
stream when a layer's attention starts asks the memory system for the weights the layer's later GEMVs will
read, so that they stream from L2 (50 MB on an H100 / H200) instead of HBM.

:func:`l2_ranges` cuts tensors' bytes into 16-byte-aligned chunks (what ``cp.async.bulk.prefetch.L2.global``
takes), in order, up to a byte budget, once; :func:`l2_prefetch` launches one program per ``BLOCK`` chunks,
each lane issuing one bulk prefetch. A prefetch is a hint: nothing is written, no result depends on it, and
an address past the end of an allocation is never asked for (a chunk's end is rounded down). It needs sm_90
PTX; elsewhere (older GPUs, CPU tensors, Triton's interpreter, which has no inline assembly) the launcher does
nothing and says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ._common import HAS_TRITON, _interpreting, cdiv, next_pow2, tl, triton
from ._pdl import _sm90
from .errors import KernelInputError

__all__ = ["CHUNK_BYTES", "MODES", "L2Ranges", "bulk_prefetch_l2", "l2_prefetch", "l2_prefetch_supported",
           "l2_ranges"]

CHUNK_BYTES = 32 * 1024  # bytes a bulk prefetch asks for: a 30-MB layer is ~1,000 of them over ~30 programs
BLOCK = 32               # chunks a program issues (one per lane of its one warp)


@dataclasses.dataclass(frozen=True)
class L2Ranges:
    """Chunks to prefetch: start addresses (int64) and sizes (int32, multiples of 16) on one CUDA device."""

    addr: torch.Tensor
    size: torch.Tensor
    nbytes: int  # the chunks' sum
    chunk: int = CHUNK_BYTES  # the largest a chunk may be

    def __len__(self) -> int:
        return self.addr.numel()


def l2_ranges(tensors: Sequence[torch.Tensor], budget: int, chunk: int = CHUNK_BYTES) -> L2Ranges:
    """The bytes of ``tensors`` (each contiguous), in order, cut into chunks of at most ``chunk`` bytes, until
    ``budget`` bytes are covered (the last tensor taken may be cut short). Each tensor's range is rounded
    inward to 16 bytes: a start up, an end down. Tensors on other devices than the first are an error."""
    if chunk <= 0 or chunk % 16:
        raise KernelInputError(f"chunk must be a positive multiple of 16 bytes, got {chunk}")
    addrs: list[int] = []
    sizes: list[int] = []
    left = max(0, int(budget))
    device = tensors[0].device if tensors else torch.device("cpu")
    for i, t in enumerate(tensors):
        if t.device != device:
            raise KernelInputError(f"tensor {i} is on {t.device}, the first on {device}")
        if not t.is_contiguous():
            raise KernelInputError(f"tensor {i} is not contiguous: its bytes are not one range")
        start = t.data_ptr()
        lo, hi = -(-start // 16) * 16, (start + t.numel() * t.element_size()) // 16 * 16
        hi = min(hi, lo + left // 16 * 16)
        for a in range(lo, hi, chunk):
            addrs.append(a)
            sizes.append(min(chunk, hi - a))
        left -= max(0, hi - lo)
        if left < 16:
            break
    return L2Ranges(torch.tensor(addrs, dtype=torch.int64, device=device),
                    torch.tensor(sizes, dtype=torch.int32, device=device), sum(sizes), chunk)


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether :func:`l2_prefetch` launches on ``device``: a CUDA device of compute capability 9.0 or more,
    Triton importable and not interpreting."""
    return HAS_TRITON and device.type == "cuda" and not _interpreting() and _sm90(device.index)


if HAS_TRITON:

    @triton.jit
    def bulk_prefetch_l2(addr, size, on):
        """``cp.async.bulk.prefetch.L2.global [addr], size`` per lane where ``on`` is non-zero (sm_90; addr
        int64, 16-byte aligned; size int32, a multiple of 16)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }\n"
            "mov.b32 $0, 0;",
            "=r,l,r,r", [addr, size, on], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def line_prefetch_l2(addr, on):
        """``prefetch.global.L2::evict_last [addr]`` (one 128-byte line) per lane where ``on`` is non-zero."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; }\n"
            "mov.b32 $0, 0;",
            "=r,l,r", [addr, on], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _l2_prefetch_kernel(addr_ptr, size_ptr, C, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < C
        addr = tl.load(addr_ptr + i, mask=ok, other=0)
        size = tl.load(size_ptr + i, mask=ok, other=0)
        bulk_prefetch_l2(addr, size, ok.to(tl.int32))

    @triton.jit
    def _l2_prefetch_lines_kernel(addr_ptr, size_ptr, LINES: tl.constexpr):
        c = tl.program_id(0)  # one chunk a program, one 128-byte line a lane
        addr = tl.load(addr_ptr + c)
        size = tl.load(size_ptr + c)
        off = tl.arange(0, LINES).to(tl.int64) * 128
        line_prefetch_l2(addr + off, (off < size).to(tl.int32))
else:  # pragma: no cover - depends on the install
    bulk_prefetch_l2 = None

MODES = ("bulk", "lines")


def l2_prefetch(ranges: L2Ranges, mode: str = "bulk") -> bool:
    """Ask for ``ranges`` to be brought into L2, on the current stream; returns whether a kernel was launched
    (False where :func:`l2_prefetch_supported` is not, or there is nothing to fetch). The kernel waits for
    nothing and writes nothing: launch it on a side stream so that the kernels after it do not wait for it.

    ``mode``: "bulk", one ``cp.async.bulk.prefetch.L2`` a chunk (a lane of a one-warp program issues it); or
    "lines", one ``prefetch.global.L2::evict_last`` a 128-byte line (a program of 256 lanes a chunk): more
    instructions, and a hint the L2 keeps for the GEMV's read, in case bulk prefetches from programs that have
    exited do not land (``bench/l2_prefetch_gpu.py`` compares the two)."""
    if mode not in MODES:
        raise KernelInputError(f"mode must be one of {MODES}, got {mode!r}")
    c = len(ranges)
    if not c or not l2_prefetch_supported(ranges.addr.device):
        return False
    if mode == "lines":
        _l2_prefetch_lines_kernel[(c,)](ranges.addr, ranges.size, LINES=next_pow2(cdiv(ranges.chunk, 128)),
                                        num_warps=4)
        return True
    _l2_prefetch_kernel[(cdiv(c, BLOCK),)](ranges.addr, ranges.size, c, BLOCK=BLOCK, num_warps=1)
    return True
