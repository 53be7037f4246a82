"""Weight-only quantized linear layers for the CPU, and the packing they run on.

Formats (``WEIGHT_FORMATS``), all weight-only (activations stay fp32 between layers):

* ``int4`` — 4-bit asymmetric round-to-nearest with one (scale, offset) per group of ``group_size``
  input columns: ``w = scale * u + offset``, ``u`` in 0..15. GGUF's Q4_1 (group 32, fp16 ``d``/``m``) and
  Q4_K (super-blocks of 256 with 6-bit sub-block scales and mins, decoded here to one fp32
  scale/offset per group of 32) are the same arithmetic, so they load into the same layer unchanged.
* ``int8`` — 8-bit symmetric round-to-nearest with one scale per group of columns, and GGUF Q8_0 (int8
  with an fp16 scale per 32 columns): split exactly into two 4-bit planes, ``q = 16 * hi + lo`` (``hi`` in
  -8..7, ``lo`` in 0..15), each an :class:`Int4Linear` plane with its own group scales: the sum of the
  two planes' products is the int8 product, at one byte per weight, on the int4 kernel.
* ``int8-channel`` — 8-bit symmetric with one scale per output channel (``aten._weight_int8pack_mm``).
* ``int4`` keeps the LM head at group-wise int8 (:data:`HEAD_FORMAT`).

The matmul: torch's packed CPU kernels. ``aten._weight_int4pack_mm_for_cpu`` (AVX-512, group-wise
scales and zero points in bf16, activations in bf16) runs a one-row product of a SmolLM2 MLP projection
in ~50 us at one thread where the oneDNN-packed fp32 weight takes ~180 us; ``aten._weight_int8pack_mm``
(per-channel bf16 scales) ~50 us. Both kernels are *slower* than an fp32 GEMM on an fp32 weight past a few
rows (11 vs 5.5 ms at 512 rows) — but a quantized layer has no fp32 weight: its many-row products
dequantize it first (~5.5 ms for one SmolLM2 layer's seven linears, ~350 ms for the 49152 x 576 Q8_0 head,
at one thread), so the kernels win up to ~64-128 rows once that is counted (docs/benchmarks.md, "Offline
throughput with quantized weights"). Products of up to :data:`KERNEL_MAX_ROWS` = 64 rows (decode batches,
short prefill chunks) run on the kernels — :mod:`kernels.cpu`'s (int8 activations, as llama.cpp) where
the layer has that layout, Q4_1-shaped layers up to :data:`NATIVE_MAX_ROWS` = 16 rows and torch's one-plane
kernel above (bf16 activations: faster past a few rows on the measured box, and closer to fp32), Q8_0-shaped
ones all the way (torch runs their two planes as two products: 1.5x slower at 16-64 rows); more rows (long prefill
chunks) dequantize the weight to fp32 for the call and use the fp32 GEMM, with exact fp32 numbers, the fp32
copy living only for that call. Kernel rows differ from the dequantized fp32 model by the rounding of
activations and scales (measured in docs/benchmarks.md).

The kernels' packed layout (``_convert_weight_to_int4pack_for_cpu``, innerKTiles 1): ``[N, K/2]`` uint8,
flat index ``b * 32K + k * 32 + j`` for row ``64 b + j`` (low nibble) and row ``64 b + 32 + j`` (high
nibble) where torch's kernel runs on AVX-512; blocks of 32 rows (``b * 16K + k * 16 + j``, rows ``32 b + j``
and ``32 b + 16 + j``) on AVX2 (:func:`packed_row_block` probes which). :func:`unpack_int4` reads it back
(dequantizing rows for an embedding lookup, or a whole weight for prefill).

Native kernels first: where :mod:`kernels.cpu` builds (AVX2/FMA/F16C and a C++ compiler), a Q4_1-shaped
layer (one plane, groups of 32, fp16 scale/offset: GGUF Q4_1, RTN ``int4``) or a Q8_0-shaped one
(``q8_0_linear``'s two planes) runs its few-row products on a copy of its weights in the GGUF block layout,
made at its first such product, with activations rounded to int8 per block of 32 as llama.cpp does (the
numbers: the dequantized weight times those activations, to float rounding). That copy is one more
4-bit (Q4_1) or 8-bit (Q8_0) copy of the layer's weights; torch's packed copy stays for prefill and the
fallback. On the 2-core AMD EPYC at one thread (bench: docs/benchmarks.md) the Q4_1 one-row product of a
1536 x 576 MLP projection takes ~45 us where ``_weight_int4pack_mm_for_cpu`` takes ~155 us.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("fp32", "native", "int8", "int8-channel", "int4")
KERNEL_MAX_ROWS = 64  # rows per product on the kernels; more dequantize (see the module docstring)
NATIVE_MAX_ROWS = 16  # of those, rows on kernels.cpu's Q4_1 kernel; more on torch's (Q8_0: the native one)
_ROW_BLOCK = 64  # packing takes rows in multiples of 64 (the layout's blocks: packed_row_block())


class QuantError(ValueError):
    """A weight or a format that cannot be quantized as asked (shape, group size, unknown format)."""


def int4_kernel_available() -> bool:
    """Whether this torch build has the packed int4 CPU matmul."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] integers in 0..15 -> the int4 CPU kernel's packed ``[N, K/2]`` uint8."""
    n, k = u.shape
    if n % _ROW_BLOCK or k % 2:
        raise QuantError(f"int4 packing needs rows % {_ROW_BLOCK} == 0 and even columns, got {n}x{k}")
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 1)


@functools.cache
def packed_row_block() -> int:
    """Rows per interleaved block of torch's packed int4 CPU layout: 64 where its kernel was dispatched for
    AVX-512, 32 on AVX2 (e.g. the AMD EPYC box), read once from a probe packing."""
    u = torch.randint(0, 16, (_ROW_BLOCK, 32), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack_int4(u)
    for block in (64, 32):
        b = packed.view(_ROW_BLOCK // block, 32, block // 2)
        if torch.equal(torch.stack([b & 15, b >> 4], dim=1).permute(0, 1, 3, 2).reshape(u.shape).int(), u):
            return block
    raise QuantError("torch's packed int4 CPU layout is neither of the known ones (rows in blocks of 64 or 32)")


def unpack_int4(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The packed layout back to u [N, K] uint8 (or only ``rows`` [R] -> [R, K])."""
    n, half = packed.shape
    k, block = 2 * half, packed_row_block()
    blocks = packed.view(n // block, k, block // 2)                     # [N/B, K, B/2]
    if rows is None:
        u = torch.stack([blocks & 15, blocks >> 4], dim=1)             # [N/B, 2, K, B/2]
        return u.permute(0, 1, 3, 2).reshape(n, k)
    b, j = rows // block, rows % block
    picked = blocks[b, :, j % (block // 2)]                             # [R, K]
    return torch.where((j < block // 2)[:, None], picked & 15, picked >> 4)


@dataclass
class Int4Plane:
    """One 4-bit plane: ``w = scale * u + offset`` per group of columns (scale/offset [N, K/group])."""

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def kernel_scales(self) -> torch.Tensor:
        """The kernel's ``[K/group, N, 2]`` bf16 (scale, zero) with ``w = (u - 8) * scale + zero``."""
        s, o = self.scale.float(), self.offset.float()
        return torch.stack([s, o + 8 * s], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


class QuantLinear(nn.Module):
    """Common behaviour: fp32 in and out, kernel for few rows, fp32 dequantized GEMM for many."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    kernel_max_rows: int = KERNEL_MAX_ROWS
    native_max_rows: int = NATIVE_MAX_ROWS  # of those, rows on the native kernel where the layer has one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] fp32 -> [..., out] fp32."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.kernel_max_rows:
            native = self._native() if x2.shape[0] <= self.native_max_rows else None
            out = native(x2) if native is not None else self._kernel(x2.to(torch.bfloat16)).float()
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x2.float(), self.dequantize(), self.bias)
        return out.reshape(*lead, self.out_features)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _native(self):
        """The native few-row product (fp32 ``x [M, K] -> [M, N]``) for this layer, or None."""
        return None

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quant_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Bytes this layer holds (quantized data, scales, the kernel's scale copies, bias)."""
        extra = [self.bias] if self.bias is not None else []
        return sum(t.numel() * t.element_size() for t in self.quant_tensors() + extra)


class Int4Linear(QuantLinear):
    """A linear over one or more 4-bit planes (one: int4 / Q4_1 / Q4_K; two: Q8_0 as hi/lo nibbles).

    The quantized tensors are plain attributes, not buffers, so ``model.to(dtype=...)`` cannot cast the
    fp16 scales or the bf16 kernel scales; they are CPU-only, like the kernel.
    """

    def __init__(self, planes: list[Int4Plane], group_size: int, in_features: int,
                 bias: torch.Tensor | None = None, kind: str = "int4") -> None:
        super().__init__()
        n = planes[0].packed.shape[0]
        if in_features % group_size or planes[0].scale.shape != (n, in_features // group_size):
            raise QuantError(f"scales {tuple(planes[0].scale.shape)} do not fit {n}x{in_features} "
                             f"in groups of {group_size}")
        self.in_features, self.out_features, self.group_size, self.kind = in_features, n, group_size, kind
        self.planes = planes
        if len(planes) == 2:  # torch runs two products where the native Q8_0 kernel runs one: 1.5x at 16-64 rows
            self.native_max_rows = KERNEL_MAX_ROWS
        self._kernel_scales = [p.kernel_scales() for p in planes]
        self._native_fn = None      # None: not looked at yet; False: not eligible (see _native)
        self._native_tensors: list[torch.Tensor] = []
        self._native_operands: list[torch.Tensor] | None = None  # what the native kernel reads
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def _native(self):
        """The layer in the native kernels' GGUF block layout (:mod:`kernels.cpu`), made at the first
        few-row product (so a fused product's parts, never called alone, never get one) and kept; None
        where the kernels are unavailable or the layer is neither Q4_1-shaped (one plane, groups of 32,
        fp16 scale and offset) nor Q8_0-shaped (the two planes of :func:`q8_0_linear`, groups of 32)."""
        if self._native_fn is None:
            self._native_fn = _native_product(self) or False
        return self._native_fn or None

    def native_operands(self) -> list[torch.Tensor] | None:
        """The native layout's tensors (``[qs, d, m]`` Q4_1, ``[qs, d]`` Q8_0; made now if not yet), as the
        fused decode step (``kernels.cpu.decode_step``) takes them; None where :meth:`_native` is None."""
        return self._native_operands if self._native() is not None else None

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        out = None
        for plane, sz in zip(self.planes, self._kernel_scales, strict=True):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, plane.packed, self.group_size, sz)
            out = y if out is None else out.float() + y.float()
        return out

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weight [N, K] (or rows [R] of it), exactly ``scale * u + offset`` summed over planes."""
        w = None
        for p in self.planes:
            s, o = (p.scale, p.offset) if rows is None else (p.scale[rows], p.offset[rows])
            u = unpack_int4(p.packed, rows)
            r, g = s.shape
            # broadcast the group scales (no expanded copies): 8x faster than repeat_interleave here
            part = torch.addcmul(o.float()[..., None], s.float()[..., None], u.view(r, g, self.group_size))
            w = part.view(r, g * self.group_size) if w is None else w + part.view(r, g * self.group_size)
        return w

    def quant_tensors(self) -> list[torch.Tensor]:
        return ([t for p in self.planes for t in (p.packed, p.scale, p.offset)] + self._kernel_scales
                + self._native_tensors)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"group_size={self.group_size}, planes={len(self.planes)}")


def _native_product(layer: Int4Linear):
    """A closure running ``layer``'s few-row product on the native kernels, or None (see Int4Linear._native)."""
    from kernels import cpu as native

    planes = layer.planes
    if layer.group_size != 32 or not native.available():
        return None
    if len(planes) == 1 and planes[0].scale.dtype == planes[0].offset.dtype == torch.float16:
        p = planes[0]
        qs = native.q4_1_from_u(unpack_int4(p.packed))
        d, m = p.scale.contiguous(), p.offset.contiguous()
        layer._native_tensors, layer._native_operands = [qs], [qs, d, m]
        return native.q4_1_linear(qs, d, m)
    if len(planes) == 2 and planes[1].scale.dtype == torch.float16 and not planes[1].offset.float().any():
        hi, lo = planes
        d = lo.scale.contiguous()
        if not (torch.equal(hi.scale.float(), 16 * d.float()) and torch.equal(hi.offset.float(), -128 * d.float())):
            return None
        q = (16 * (unpack_int4(hi.packed).to(torch.int16) - 8) + unpack_int4(lo.packed)).to(torch.int8)
        layer._native_tensors, layer._native_operands = [q], [q, d]
        return native.q8_0_linear(q, d)
    return None


class Int8Linear(QuantLinear):
    """int8 weights with one scale per output channel (``aten._weight_int8pack_mm``)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise QuantError(f"int8 weight needs int8 [N, K] and scales [N], got {q.dtype} {tuple(q.shape)} "
                             f"and {tuple(scale.shape)}")
        self.out_features, self.in_features = q.shape
        self.kind, self.q, self.scale = "int8-channel", q.contiguous(), scale.float()
        self._kernel_scale = self.scale.to(torch.bfloat16)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(xb, self.q, self._kernel_scale)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        q, s = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        return q.float() * s[:, None]

    def quant_tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale, self._kernel_scale]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind=int8 per-channel"


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the looked-up rows of a (tied) quantized head."""

    def __init__(self, linear: QuantLinear) -> None:
        super().__init__()
        self.linear = linear
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., dim] fp32."""
        flat = ids.reshape(-1)
        return self.linear.dequantize(flat).reshape(*ids.shape, self.embedding_dim)


# ---- GGUF blocks ([rows, bytes per row] uint8, as gguf.GGUFReader gives them) ---------------------

def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[N, G * block_bytes] uint8 -> [N, G, block_bytes]."""
    n, nbytes = raw.shape
    if nbytes % block_bytes:
        raise QuantError(f"row of {nbytes} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(n, nbytes // block_bytes, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian) -> [...] fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def decode_q4_1(raw: torch.Tensor) -> Int4Linear:
    """GGUF Q4_1 (blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d * u + m), kept 4-bit."""
    blk = _blocks(raw, 20)
    d, m, qs = _f16(blk[..., 0:2]), _f16(blk[..., 2:4]), blk[..., 4:]
    u = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(raw.shape[0], -1)   # x[j], x[j + 16]
    return Int4Linear([Int4Plane(pack_int4(u), d, m)], 32, u.shape[1], kind="q4_1")


def decode_q8_0(raw: torch.Tensor) -> Int4Linear:
    """GGUF Q8_0 (blocks of 32: fp16 d, 32 int8; w = d * q) as two exact 4-bit planes."""
    blk = _blocks(raw, 34)
    d, q = _f16(blk[..., 0:2]), blk[..., 2:].contiguous().view(torch.int8)
    return q8_0_linear(q.reshape(raw.shape[0], -1), d)


def _q4_k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K super-block -> 6-bit (scale, min) of its 8 sub-blocks [..., 8]."""
    s = sc.to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1), torch.cat([low_m, high_m], -1)


def decode_q4_k(raw: torch.Tensor) -> Int4Linear:
    """GGUF Q4_K (super-blocks of 256: fp16 d, dmin, 12 bytes of 6-bit sub-scales, 128 of nibbles;
    w = d * sc * u - dmin * m per sub-block of 32), kept 4-bit with fp32 per-32 scale/offset."""
    blk = _blocks(raw, 144)
    n, nsb = blk.shape[:2]
    d, dmin = _f16(blk[..., 0:2]).float(), _f16(blk[..., 2:4]).float()
    sc, mn = _q4_k_scales(blk[..., 4:16])
    qs = blk[..., 16:].reshape(n, nsb, 4, 32)               # 4 chunks of 64 values: low, then high nibbles
    u = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nsb * 256)
    scale = (d[..., None] * sc).reshape(n, nsb * 8)
    offset = (-dmin[..., None] * mn).reshape(n, nsb * 8)
    return Int4Linear([Int4Plane(pack_int4(u), scale, offset)], 32, u.shape[1], kind="q4_k")


GGUF_DECODERS = {"Q4_1": decode_q4_1, "Q8_0": decode_q8_0, "Q4_K": decode_q4_k}


# ---- round-to-nearest quantizers ------------------------------------------------------------------

def quantize_int4(w: torch.Tensor, group_size: int = 32, bias: torch.Tensor | None = None) -> Int4Linear:
    """RTN int4, asymmetric per group: offset = group min, scale = (max - min) / 15 (as GGUF Q4_1)."""
    n, k = w.shape
    if k % group_size:
        raise QuantError(f"in_features {k} is not a multiple of group_size {group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    # scales rounded to fp16 *before* rounding the weights (as GGUF does): exact and half the bytes
    scale, lo = _fp16_grid((hi - lo) / 15), _fp16_grid(lo)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: u = 0, w = offset
    u = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).reshape(n, k)
    return Int4Linear([Int4Plane(pack_int4(u), _compact(scale), _compact(lo))], group_size, k, bias)


def quantize_int8_grouped(w: torch.Tensor, group_size: int = 32, bias: torch.Tensor | None = None) -> Int4Linear:
    """RTN int8, symmetric per group of columns (as GGUF Q8_0 at group 32): scale = absmax / 127."""
    n, k = w.shape
    if k % group_size:
        raise QuantError(f"in_features {k} is not a multiple of group_size {group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    scale = _fp16_grid(g.abs().amax(-1) / 127)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q8_0_linear(q, scale, bias, group_size, kind="int8")


def quantize_int8(w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """RTN int8, symmetric per output channel: scale = absmax / 127."""
    wf = w.detach().float()
    scale = wf.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (wf / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Linear(q, scale, bias)


def _fp16_grid(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest fp16 (kept fp32 where fp16 would overflow)."""
    half = t.to(torch.float16).float()
    return torch.where(torch.isfinite(half), half, t)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """fp16 when that holds the fp32 values exactly (powers of two times an fp16 scale do), else fp32."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t) else t


def q8_0_linear(q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                group_size: int = 32, kind: str = "q8_0") -> Int4Linear:
    """Q8_0-style int8 (q [N, K], one scale d [N, K/group] per group) as two exact 4-bit planes."""
    qi = q.to(torch.int16)
    hi, lo = qi >> 4, qi & 15                    # q = 16 * hi + lo, hi in -8..7, lo in 0..15
    df = d.float()
    hi_s, hi_o = _compact(16 * df), _compact(-128 * df)   # w_hi = 16 d (u - 8)
    planes = [Int4Plane(pack_int4(hi + 8), hi_s, hi_o),
              Int4Plane(pack_int4(lo), _compact(df), torch.zeros_like(_compact(df)))]
    return Int4Linear(planes, group_size, q.shape[1], bias, kind=kind)


def quantize_linear(linear: nn.Module, fmt: str, group_size: int = 32) -> QuantLinear:
    """An ``nn.Linear`` (or a packed one) as an ``int4`` / ``int8`` / ``int8-channel`` quantized layer."""
    w, b = linear.weight, linear.bias
    if fmt == "int4":
        return quantize_int4(w, group_size, b)
    if fmt == "int8":
        return quantize_int8_grouped(w, group_size, b)
    if fmt == "int8-channel":
        return quantize_int8(w, b)
    raise QuantError(f"unknown quantized format {fmt!r} (expected int4, int8 or int8-channel)")


# The LM head (tied to the embedding in SmolLM2) at 4 bits alone costs most of int4's error (measured:
# KL 0.073 vs fp32 with a 4-bit head; docs/benchmarks.md); llama.cpp keeps it at 6-8 bits for the same
# reason, so int4 keeps the head at group-wise int8.
HEAD_FORMAT = {"int4": "int8"}


def quantize_model(model: nn.Module, fmt: str, group_size: int = 32, quantize_head: bool = False) -> int:
    """Swap every CPU ``nn.Linear`` of a Llama model (and a tied embedding) for ``fmt``; return how many.

    The head takes ``HEAD_FORMAT[fmt]`` unless ``quantize_head`` (then ``fmt`` like the rest)."""
    if fmt in ("fp32", "native"):
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    head = getattr(model, "lm_head", None)
    for parent, name, child in swaps:
        kind = fmt if quantize_head or child is not head else HEAD_FORMAT.get(fmt, fmt)
        setattr(parent, name, quantize_linear(child, kind, group_size))
    tie_embedding(model)
    return len(swaps)


def tie_embedding(model: nn.Module) -> None:
    """With tied embeddings the lookup reads the quantized head's rows (no fp32 table kept)."""
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(model.lm_head, QuantLinear):
        model.model.embed_tokens = QuantEmbedding(model.lm_head)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the model's weights: quantized layers (all their tensors) and the rest."""
    quant = {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}
    q_bytes = sum(m.resident_bytes() for m in quant.values())
    skip = {id(m.bias) for m in quant.values() if m.bias is not None}
    params = {id(p): p for p in list(model.parameters()) + list(model.buffers()) if id(p) not in skip}
    other = sum(p.numel() * p.element_size() for p in params.values() if p.device.type != "meta")
    return {"quantized": q_bytes, "other": other, "total": q_bytes + other}
