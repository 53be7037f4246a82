"""Lossless block-quantized storage for tensors that came from a quantized checkpoint (the client bundle).

The default model ships as a Q4_1 GGUF and is dequantized once to fp32 on load, so its layer weights are,
exactly, ``d * q + m`` per block of 32 (``q`` in 0..15, ``d`` and ``m`` fp16) and its token embedding
``d * q`` (Q8_0: ``q`` in -127..127, ``d = absmax / 127`` fp16). :func:`pack` recovers those codes and
keeps them only if dequantizing them reproduces every fp32 value exactly, so a bundle stored this way
loses nothing (and any tensor that was not quantized, like the norm gains, stays fp32).
Q4_1 costs 5 bits per weight (4 + two fp16 per 32), Q8_0 8.5, against fp32's 32.
"""

from __future__ import annotations

import torch

BLOCK = 32
KINDS = ("q4_1", "q8_0")


def _blocks(t: torch.Tensor) -> torch.Tensor | None:
    if t.dtype != torch.float32 or t.numel() % BLOCK or t.numel() == 0:
        return None
    return t.detach().reshape(-1, BLOCK)


def _q4_1(b: torch.Tensor) -> dict[str, torch.Tensor] | None:
    mn, mx = b.min(1).values, b.max(1).values
    d, m = ((mx - mn) / 15).half(), mn.half()
    df, mf = d.float()[:, None], m.float()[:, None]
    q = torch.where(df > 0, (b - mf) / torch.where(df > 0, df, 1.0), 0.0).round().clamp(0, 15).to(torch.uint8)
    if not torch.equal(df * q.float() + mf, b):
        return None
    return {"q": q[:, 0::2] | (q[:, 1::2] << 4), "d": d, "m": m}


def _q8_0(b: torch.Tensor) -> dict[str, torch.Tensor] | None:
    d = (b.abs().max(1).values / 127).half()
    df = d.float()[:, None]
    q = torch.where(df > 0, b / torch.where(df > 0, df, 1.0), 0.0).round().clamp(-127, 127).to(torch.int8)
    if not torch.equal(df * q.float(), b):
        return None
    return {"q": q, "d": d}


def pack(t: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(kind, parts) if ``t`` is exactly a Q4_1 or Q8_0 dequantization, else None (store it as is)."""
    b = _blocks(t)
    if b is None:
        return None
    for kind, fn in (("q4_1", _q4_1), ("q8_0", _q8_0)):
        parts = fn(b)
        if parts is not None:
            return kind, parts
    return None


def unpack(kind: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that :func:`pack` encoded (ValueError on inconsistent parts)."""
    try:
        if kind == "q4_1":
            packed = parts["q"]
            q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], BLOCK)
            out = parts["d"].float()[:, None] * q.float() + parts["m"].float()[:, None]
        elif kind == "q8_0":
            out = parts["d"].float()[:, None] * parts["q"].float()
        else:
            raise ValueError(f"unknown quantization {kind!r}")
        return out.reshape(shape)
    except (KeyError, RuntimeError) as exc:
        raise ValueError(f"inconsistent {kind} parts: {exc}") from exc


__all__ = ["KINDS", "pack", "unpack"]
