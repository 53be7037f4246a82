"""GPTQ and AWQ safetensors layouts: read into the engine's int4 layers without an fp32 pass, and write.

Both formats hold, per linear, integers ``q`` in ``0..2**bits - 1`` with one fp16 ``scale`` and one integer
``zero`` per group of ``group_size`` input columns, ``w = scale * (q - zero)``. That is
:class:`~engine.quant.Int4Linear`'s ``w = scale * u + offset`` with ``offset = -scale * zero`` (exact in fp32:
an fp16 times a small integer), so a 4-bit layer loads as one plane and an 8-bit GPTQ layer as two exact
planes (``q = 16 * hi + lo``, as Q8_0 does). :class:`IntWeights` is that integer form; the quantizers
(:mod:`engine.gptq`) produce it and the writers pack it.

Layouts (K = in_features, N = out_features, g = group_size, b = bits; every packed word is int32 and holds
``32 / b`` fields, field ``j`` at bits ``[b * j, b * j + b)``):

GPTQ (AutoGPTQ, GPTQModel, optimum / transformers; ``quant_method = "gptq"``)::

    qweight [K * b / 32, N]  word [i, n] field j = q[n, (32 / b) * i + j]     (packed along the input dim)
    qzeros  [K / g, N * b / 32]  word [G, c] field j = zero[(32 / b) * c + j, G], stored minus one in
                             ``checkpoint_format = "gptq"`` (v1: read as field + 1, unmasked, as its readers
                             do), as is in ``"gptq_v2"``
    scales  [K / g, N] fp16
    g_idx   [K] int32        group of each input column; act-order (``desc_act``) without static groups makes
                             it non-monotone: refused (the engine cannot permute a layer's input columns)

AWQ (AutoAWQ GEMM; ``quant_method = "awq"``, ``version = "gemm"``, 4-bit, ``zero_point``)::

    qweight [K, N / 8]   word [k, c] field j = q[8 c + AWQ_ORDER[j], k]  (packed along the output dim,
                         interleaved)
    qzeros  [K / g, N / 8]  the same interleave over zero[:, G]
    scales  [K / g, N] fp16

Which path runs them: a 4-bit layer at g = 32 whose offsets are fp16-exact is Q4_1-shaped and takes the native
kernel (``kernels.cpu``); every other group size (64/128/256, GPTQ's and AWQ's usual 128) and 8-bit GPTQ take
torch's ``_weight_int4pack_mm_for_cpu`` (one or two planes). Unsupported variants raise
:class:`~engine.errors.UnsupportedModelError` naming the ``quantization_config`` field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant import Int4Linear, Int4Plane, QuantError, _compact, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # field j of an AWQ word holds output column 8 c + AWQ_ORDER[j]
KERNEL_GROUPS = (32, 64, 128, 256)     # group sizes torch's int4 CPU kernel takes
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
METHODS = ("gptq", "awq")


@dataclass
class IntWeights:
    """One linear as GPTQ/AWQ integers: ``w = scale * (q - zero)`` per group of ``group_size`` columns.

    q [N, K] int (0..2**bits - 1); scale [N, K/g] fp16; zero [N, K/g] int.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        """fp32 weight [N, K], computed straight from the integers (the layout's definition)."""
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group_size, self.group_size)
        return (self.scale.float()[..., None] * (q - self.zero.float()[..., None])).view(n, k)

    def to_linear(self, bias: torch.Tensor | None = None, kind: str = "gptq") -> Int4Linear:
        """The engine's int4 layer holding exactly these weights (one plane at 4 bits, two at 8)."""
        s = self.scale.float()
        offset = _compact(-s * self.zero.float())           # exact: fp16 times a small integer
        q = self.q.to(torch.int32)
        if self.bits == 4:
            planes = [Int4Plane(pack_int4(q), self.scale, offset)]
        else:                                               # q = 16 hi + lo: w = 16 s hi - s z + s lo
            planes = [Int4Plane(pack_int4(q >> 4), _compact(16 * s), offset),
                      Int4Plane(pack_int4(q & 15), self.scale, torch.zeros_like(self.scale))]
        return Int4Linear(planes, self.group_size, q.shape[1], bias, kind=kind)


# ---- bit fields -------------------------------------------------------------------------------------

def pack_fields(v: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers -> int32 words of ``32 / bits`` consecutive values along ``dim`` (field j at bits b*j)."""
    per = 32 // bits
    v = (v.to(torch.int64) & ((1 << bits) - 1)).movedim(dim, -1)
    if v.shape[-1] % per:
        raise QuantError(f"{v.shape[-1]} values do not pack into whole {per}-field words")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = (v << (torch.arange(per) * bits)).sum(-1)       # disjoint fields: the sum is the OR
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def unpack_fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their ``32 / bits`` fields each along ``dim`` (int32 values 0..2**bits - 1)."""
    if words.dtype != torch.int32:
        raise QuantError(f"packed weights must be int32, got {words.dtype}")
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    f = (w[..., None] >> (torch.arange(per) * bits)) & ((1 << bits) - 1)
    return f.reshape(*w.shape[:-1], w.shape[-1] * per).to(torch.int32).movedim(-1, dim)


def _awq_interleave(cols: torch.Tensor) -> torch.Tensor:
    """[..., N] in output order -> [..., N] in AWQ's field order (field j of word c <- column 8c + ORDER[j])."""
    return cols.reshape(*cols.shape[:-1], -1, 8)[..., list(AWQ_ORDER)].reshape(cols.shape)


def _awq_deinterleave(fields: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(fields).reshape(*fields.shape[:-1], -1, 8)
    out[..., list(AWQ_ORDER)] = fields.reshape(out.shape)
    return out.reshape(fields.shape)


# ---- writers ----------------------------------------------------------------------------------------

def gptq_tensors(prefix: str, iw: IntWeights, v1: bool = True) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one linear (v1 stores ``zero - 1``)."""
    k = iw.q.shape[1]
    return {f"{prefix}.qweight": pack_fields(iw.q.T, iw.bits, 0),                # [K*b/32, N]
            f"{prefix}.qzeros": pack_fields(iw.zero.T - int(v1), iw.bits, 1),    # [K/g, N*b/32]
            f"{prefix}.scales": iw.scale.T.to(torch.float16).contiguous(),       # [K/g, N]
            f"{prefix}.g_idx": (torch.arange(k) // iw.group_size).to(torch.int32)}


def awq_tensors(prefix: str, iw: IntWeights) -> dict[str, torch.Tensor]:
    """The AWQ GEMM tensors of one linear (4-bit)."""
    if iw.bits != 4:
        raise QuantError(f"AWQ GEMM is 4-bit only, got {iw.bits}")
    return {f"{prefix}.qweight": pack_fields(_awq_interleave(iw.q.T), 4, 1),      # [K, N/8]
            f"{prefix}.qzeros": pack_fields(_awq_interleave(iw.zero.T), 4, 1),    # [K/g, N/8]
            f"{prefix}.scales": iw.scale.T.to(torch.float16).contiguous()}        # [K/g, N]


def gptq_config(bits: int, group_size: int, sym: bool, act_order: bool, damp: float, method: str) -> dict:
    """``quantization_config`` as optimum/transformers and GPTQModel write it (v1 when symmetric)."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
            "static_groups": act_order, "sym": sym, "true_sequential": False, "damp_percent": damp,
            "lm_head": False, "checkpoint_format": "gptq" if sym else "gptq_v2",
            "meta": {"quantizer": ["cipherlm"], "method": method}}


def awq_config(group_size: int) -> dict:
    """``quantization_config`` as AutoAWQ writes it for GEMM checkpoints."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


# ---- readers ----------------------------------------------------------------------------------------

def _refuse(source: str, field: str, value, supported) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: quantization_config.{field} = {value!r} is not supported "
                                 f"(this loader reads {supported})")


def check_config(qcfg: dict, source: str) -> tuple[str, int, int]:
    """(method, bits, group_size) of a GPTQ/AWQ ``quantization_config``; unsupported variants refused."""
    method, bits, g = qcfg.get("quant_method"), qcfg.get("bits", 4), qcfg.get("group_size", 128)
    if qcfg.get("dynamic"):
        raise _refuse(source, "dynamic", qcfg["dynamic"], "one config for every layer")
    if method == "gptq":
        if bits not in GPTQ_BITS:
            raise _refuse(source, "bits", bits, f"GPTQ bits {GPTQ_BITS}")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise _refuse(source, "checkpoint_format", fmt, f"{GPTQ_FORMATS}; exllama/marlin/bitblas repack")
    elif method == "awq":
        if qcfg.get("version", "gemm").lower() != "gemm":
            raise _refuse(source, "version", qcfg.get("version"), "AutoAWQ 'gemm' checkpoints")
        if bits != 4:
            raise _refuse(source, "bits", bits, "AWQ bits 4")
        if not qcfg.get("zero_point", True):
            raise _refuse(source, "zero_point", False, "AWQ with zero points")
    else:
        raise _refuse(source, "quant_method", method, "'gptq' and 'awq'")
    if g not in KERNEL_GROUPS:
        raise _refuse(source, "group_size", g, f"group sizes {KERNEL_GROUPS} (the int4 kernel's)")
    return method, bits, g


def read_gptq(state: dict[str, torch.Tensor], prefix: str, bits: int, g: int, v1: bool) -> IntWeights:
    """Pop one GPTQ linear's tensors out of ``state`` as integers."""
    qweight, qzeros = state.pop(f"{prefix}.qweight"), state.pop(f"{prefix}.qzeros")
    scales, g_idx = state.pop(f"{prefix}.scales"), state.pop(f"{prefix}.g_idx", None)
    q = unpack_fields(qweight, bits, 0).T                              # [N, K]
    k = q.shape[1]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // g):
        raise UnsupportedModelError(f"{prefix}: g_idx is not column // group_size (act-order, "
                                    f"quantization_config.desc_act without static_groups): not supported")
    zero = unpack_fields(qzeros, bits, 1).T + int(v1)                  # [N, K/g]; v1: 15 + 1 = 16, unmasked
    return IntWeights(q, scales.T.to(torch.float16).contiguous(), zero, g, bits)


def read_awq(state: dict[str, torch.Tensor], prefix: str, g: int) -> IntWeights:
    """Pop one AWQ GEMM linear's tensors out of ``state`` as integers."""
    qweight, qzeros, scales = (state.pop(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales"))
    q = _awq_deinterleave(unpack_fields(qweight, 4, 1)).T              # [N, K]
    zero = _awq_deinterleave(unpack_fields(qzeros, 4, 1)).T            # [N, K/g]
    return IntWeights(q.contiguous(), scales.T.to(torch.float16).contiguous(), zero.contiguous(), g, 4)


def read_layers(state: dict[str, torch.Tensor], qcfg: dict, source: str) -> dict[str, Int4Linear]:
    """Pop every GPTQ/AWQ linear (a ``.qweight`` tensor) out of ``state`` as an :class:`Int4Linear`."""
    method, bits, g = check_config(qcfg, source)
    v1 = method == "gptq" and qcfg.get("checkpoint_format", "gptq") == "gptq"
    out: dict[str, Int4Linear] = {}
    for prefix in [k.removesuffix(".qweight") for k in list(state) if k.endswith(".qweight")]:
        try:
            iw = read_gptq(state, prefix, bits, g, v1) if method == "gptq" else read_awq(state, prefix, g)
            if iw.q.shape[1] % g:  # the layouts allow a ragged last group; Int4Linear's groups are whole
                raise UnsupportedModelError(f"{source}: {prefix}: quantization_config.group_size = {g} does "
                                            f"not divide in_features {iw.q.shape[1]}")
            out[prefix] = iw.to_linear(kind=f"{method}-{bits}bit")
        except (KeyError, QuantError, RuntimeError) as exc:
            raise ModelLoadError(f"{source}: {method} layer {prefix}: {exc}") from exc
    if not out:
        raise ModelLoadError(f"{source}: quant_method {method!r} but no .qweight tensors")
    return out
