"""The client half of an offload plan's linear steps (docs/protocol.md, "Offload steps").

When the manifest carries an ``offload`` section, the server runs, besides its attention blocks, the MLP
of every layer the plan places there, under a second, small key set (N = 8192, ``offload.mlp.ckks``).
Per such layer and token the client, which holds the residual stream ``h``:

1. normalizes ``x̂ = h / rms(h)`` (float64, no gain: the server folds it in), encrypts it replicated with
   period P1 and sends an ``mlp_up`` step;
2. decrypts ``[gate|up]``, computes ``a = silu(g) * u`` exactly, encrypts ``a`` replicated with period P2
   and sends an ``mlp_down`` step;
3. decrypts ``W_down a`` and adds it to ``h``.

Every layer whose attention the plan runs as linear steps (``softmax = client``, manifest
``offload.server_attention_linear``) has a seam for attention beside the MLP's, under the same key set:

1. normalizes ``x̂ = h / rms(h)`` (float64, no gain), encrypts it replicated and sends an ``attn_qkv`` step;
2. decrypts ``[q; k; v]``, applies RoPE, appends k, v to its own clear K/V cache (the runtime's dense
   cache: the client's own data) and computes the exact causal softmax attention ``u`` as the model does;
3. encrypts ``u`` replicated, sends an ``attn_o`` step, decrypts ``Wo u`` and adds it to ``h``.

With ``offload.fused`` in the manifest (a fused plan, :mod:`fhe.offload_fused`) two consecutive parts are
one step on the concatenated input ``[value; residual]``: ``o_up`` (attn_o + mlp_up) and ``down_qkv``
(mlp_down + the next layer's attn_qkv), both computed by the server on the **unnormalized** residual; the
client scales what it decrypts by ``rsqrt(mean(x²) + eps)`` of the residual it holds. The seams keep the
second half of each fused answer (``[gate|up]``, the next layer's ``[q; k; v]``) until the next seam takes it:
a run of n server layers costs 2n + 1 steps per token instead of 4n.

The layouts come from the model's shapes (:func:`fhe.offload_steps.mlp_geometry`,
:func:`fhe.offload_attention.attention_geometry`); the bundle holds no weight of a server part. Nothing
here does I/O: calls go through the runtime's ``exchange``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from client_sdk import _protocol as proto
from client_sdk._exceptions import PrivateModeError

MLP_KEY_SUFFIX = ".mlp"


@dataclasses.dataclass(frozen=True)
class OffloadInfo:
    """The manifest's ``offload`` section, checked."""

    plan_hash: str
    server_mlp: tuple[int, ...]
    mlp_ckks: dict[str, Any]
    rotation_steps: tuple[int, ...]
    max_blob_bytes: int
    #: layers whose attention runs as linear steps (absent in an older manifest: none)
    server_attention_linear: tuple[int, ...] = ()
    #: the layout of a step of >= 2 positions (``offload.mlp.chunk_layout``; absent in an older manifest: {})
    chunk_layout: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: how to upload ciphertexts (``offload.mlp.upload``): "seeded" (SEAL's seeded form; absent: an older or
    #: SEAL-backed server) or "full" (unseeded: a GPU worker reads them straight into device tensors)
    upload: str = "seeded"
    #: fused linear steps (``offload.fused``; absent in an unfused or older manifest: False)
    fused: bool = False

    @classmethod
    def from_manifest(cls, d: Any) -> OffloadInfo | None:
        """None when the server runs no offload plan (``PrivateModeError`` for a malformed section)."""
        section = d.get("offload") if isinstance(d, Mapping) else None
        if section is None:
            return None
        try:
            mlp = section["mlp"]
            info = cls(str(section["plan_hash"]), tuple(int(i) for i in section["server_mlp"]), dict(mlp["ckks"]),
                       tuple(int(s) for s in mlp["rotation_steps"]), int(mlp["max_blob_bytes"]),
                       tuple(int(i) for i in section.get("server_attention_linear", ())),
                       dict(mlp.get("chunk_layout") or {}), str(mlp.get("upload", "seeded")),
                       section.get("fused", False))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PrivateModeError(f"the server's offload manifest is malformed ({exc!r})") from exc
        if not isinstance(info.fused, bool):
            raise PrivateModeError(f"the server's offload manifest is malformed (fused = {info.fused!r:.32})")
        if info.fused and set(info.server_mlp) != set(info.server_attention_linear):
            raise PrivateModeError("the server's fused offload plan does not run attention and MLP of every server "
                                   "layer as linear steps")
        if info.upload not in ("seeded", "full"):
            raise PrivateModeError(f"the server asks for uploads as {info.upload[:32]!r}, this SDK sends 'seeded' "
                                   "or 'full': update the SDK")
        return info


class OffloadSession(proto.Session):
    """A session of an offload plan: opened with the MLP key too, and able to send MLP steps."""

    def __init__(self, *args: Any, mlp_key_id: str, mlp_fingerprint: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mlp_key_id, self.mlp_fingerprint = mlp_key_id, mlp_fingerprint

    def open_call(self) -> proto.Call:
        call = super().open_call()
        return dataclasses.replace(call, json={**call.json, "mlp_key_id": self.mlp_key_id})

    def mlp_call(self, layer: int, part: str, start: int, blobs: tuple[bytes, ...], params_hash: str,
                 count: int | None = None) -> proto.Call:
        """The ``part`` step of ``layer`` for positions ``start .. start + count`` (default: one ciphertext
        per position, ``count = len(blobs)``; a packed chunk carries fewer ciphertexts than positions)."""
        from fhe.envelope import Envelope

        if self.id is None:
            raise PrivateModeError("no open session")
        count = len(blobs) if count is None else count
        kind = "decode" if count == 1 and start > 0 else "prefill"
        body = Envelope(self.id, self.mlp_fingerprint, layer, kind, (start, count), blobs, "seal",
                        params_hash, part).to_bytes()
        # an MLP half is a tenth of an attention step at N = 32768; the attention budget bounds it
        return proto.Call("POST", f"/v1/private/sessions/{self.id}/steps", content=body,
                          read_timeout=self.manifest.step_read_timeout(count, self.read_floor))

    def mlp_result(self, reply: proto.Reply, layer: int, part: str, start: int, n_out: int) -> tuple[bytes, ...]:
        from fhe.envelope import MAX_BLOBS, parse
        from fhe.errors import FHEError

        try:
            env = parse(reply.content, 1 << 30, 1 << 34, max_blobs=max(n_out, MAX_BLOBS))
        except FHEError as exc:
            raise PrivateModeError(f"layer {layer} {part}: malformed result envelope ({exc})") from exc
        if env.layer != layer or env.part != part or env.positions[0] != start or len(env.blobs) != n_out:
            raise PrivateModeError("server answered another step")
        return env.blobs


class EncryptedMLPSeam(nn.Module):
    """The MLP of a layer whose MLP runs on the server: hands the residual to the runtime's offload half
    (the layer's ``post_attention_layernorm`` is replaced by the identity: the client normalizes in float64
    and the gain is the server's)."""

    def __init__(self, layer_idx: int, half: OffloadClient) -> None:
        super().__init__()
        self.layer_idx, self.half = layer_idx, half

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.half.mlp(self.layer_idx, h).to(h.dtype)


class LinearAttentionSeam(nn.Module):
    """The attention of a layer the plan runs as linear steps: hands the residual to the runtime's offload
    half (the layer's ``input_layernorm`` is replaced by the identity: the client normalizes in float64 and
    the gain is the server's); the softmax attention runs on the runtime's own cache (``backend.attend``)."""

    def __init__(self, layer_idx: int, half: OffloadClient) -> None:
        super().__init__()
        self.layer_idx, self.half = layer_idx, half

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: Any, backend: Any) -> torch.Tensor:
        return self.half.attention(self.layer_idx, h, positions, rope, backend).to(h.dtype)


class OffloadClient:
    """The offload key set and the linear steps (MLP and attention) of one runtime.

    Args:
        runtime: the :class:`client_sdk._runtime.PrivateRuntime` (its exchange, session, stats).
        info: the manifest's offload section.
    """

    def __init__(self, runtime: Any, info: OffloadInfo) -> None:
        from fhe.offload_attention import attention_geometry
        from fhe.offload_fused import fused_geometry
        from fhe.offload_steps import (
            NO_CHUNK_LAYOUT,
            chunk_layout_manifest,
            chunk_shapes,
            mlp_geometry,
            offload_rotation_steps,
        )
        from fhe.params import CKKSParams

        self.rt, self.info = runtime, info
        self.params = CKKSParams.from_dict(info.mlp_ckks)
        cfg = runtime.model.config
        self.layout, _ = mlp_geometry(cfg, self.params)
        self.att_layout, _ = attention_geometry(cfg, self.params)
        # None: the server sends steps of several positions one ciphertext per position (offload_chunk_layout off)
        self.chunks = (None if info.chunk_layout == NO_CHUNK_LAYOUT else
                       chunk_shapes(cfg, self.params, fused=info.fused))
        steps = offload_rotation_steps(cfg, self.params, attention=bool(info.server_attention_linear),
                                       mlp=bool(info.server_mlp), chunks=self.chunks is not None, fused=info.fused)
        # fused steps: per part its one-position layout, and the halves of answers a later seam takes
        self.fused = fused_geometry(cfg, self.params)[0] if info.fused else None
        self.pending: dict[tuple[str, int], torch.Tensor] = {}
        if steps != info.rotation_steps:
            raise PrivateModeError("the server's offload rotations do not match this model's shapes (a server "
                                   "older or newer than this SDK: chunk layouts differ)")
        if info.chunk_layout != chunk_layout_manifest(self.chunks):
            raise PrivateModeError(f"the server lays out a step of several positions as "
                                   f"{info.chunk_layout or 'one position per ciphertext'}, this SDK as "
                                   f"{chunk_layout_manifest(self.chunks)}: update the SDK or the server")
        self.start = 0          # first position of the chunk the runtime's forward is running
        self.seeded = info.upload != "full"
        self.pool: Any = None   # the forked crypto pool (client_sdk._crypto_pool), made at the first big step
        self.ckks: Any = None
        self.fingerprint = ""
        self.upload_bytes = 0

    @property
    def key_id(self) -> str:
        return self.rt.key_id + MLP_KEY_SUFFIX

    def install(self, model: nn.Module) -> nn.Module:
        """Replace each server MLP, and each attention run as linear steps, of the bundle's model by its seam."""
        for i in self.info.server_mlp:
            layer = model.model.layers[i]
            layer.mlp = EncryptedMLPSeam(i, self)
            layer.post_attention_layernorm = nn.Identity()
        for i in self.info.server_attention_linear:
            layer = model.model.layers[i]
            layer.self_attn = LinearAttentionSeam(i, self)
            layer.input_layernorm = nn.Identity()
        return model

    def make_keys(self, man: proto.Manifest) -> None:
        """A fresh MLP key set (2.6 MB of public keys: cheaper to make than to store), registered."""
        from fhe import wire
        from fhe.ckks import CKKSClient
        from fhe.envelope import pack_key_upload
        from fhe.mlp import MLPClient
        from fhe.offload_attention import AttentionLinearClient

        self.close_pool()   # its children hold the old key set
        self.ckks = CKKSClient(self.params, self.info.rotation_steps)
        upload = pack_key_upload(wire.dump_public_keys(self.ckks))
        self.fingerprint = hashlib.sha256(upload).hexdigest()
        self.half = MLPClient(self.ckks, self.layout, self.rt.model.config.rms_norm_eps)
        self.att_half = AttentionLinearClient(self.ckks, self.att_layout, self.rt.model.config.rms_norm_eps)
        reply = self.rt.exchange(proto.key_upload_call(man, self.key_id, upload, self.rt.read_floor))
        proto.check_registered(reply.json(), self.fingerprint)
        self.upload_bytes = len(upload)

    def session(self, man: proto.Manifest) -> OffloadSession:
        rt = self.rt
        return OffloadSession(man, rt.key_id, rt.fingerprint, rt.key_bytes, rt.read_floor,
                              mlp_key_id=self.key_id, mlp_fingerprint=self.fingerprint)

    # -- one MLP block over the chunk's positions ---------------------------------------------------------
    def mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] (the residual after the layer's attention) -> the MLP's output [T, hidden]."""
        from fhe.linalg import replicate_input

        if self.fused is not None:
            return self._fused_mlp(layer, h)
        lay = self.layout
        x = self._normalized(h)
        if h.shape[0] > 1 and self.chunks is not None:   # several positions: the chunk layout
            gu = torch.from_numpy(self._send_chunks(layer, "mlp_up", x.numpy()))
            a = torch.nn.functional.silu(gu[:, :lay.intermediate]) * gu[:, lay.intermediate:]
        else:
            ups = self._send(layer, "mlp_up", [replicate_input(r.numpy(), lay.slots, lay.up_periods[0]) for r in x],
                             len(lay.up_slots))
            a = torch.stack([self.half.activation(cts) for cts in ups])
        return self._mlp_down(layer, a)

    def _mlp_down(self, layer: int, a: torch.Tensor) -> torch.Tensor:
        """a [T, intermediate] (float64, ``silu(g) * u``) through an ``mlp_down`` step -> ``W_down a`` [T, hidden]."""
        from fhe.linalg import replicate_input

        if a.shape[0] > 1 and self.chunks is not None:
            return torch.from_numpy(self._send_chunks(layer, "mlp_down", a.numpy()))
        lay = self.layout
        downs = self._send(layer, "mlp_down", [replicate_input(r.numpy(), lay.slots, lay.down_period) for r in a], 1)
        return torch.stack([self.half.output(cts[0]) for cts in downs])

    # -- one attention block as linear steps over the chunk's positions ------------------------------------
    def attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, rope: Any, backend: Any
                  ) -> torch.Tensor:
        """h [T, hidden] (the residual before the layer) -> the attention output [T, hidden]."""
        half, t = self.att_half, h.shape[0]
        chunked = t > 1 and self.chunks is not None   # several positions (prefill, verify): the chunk layout
        if self.fused is not None and layer - 1 in self.info.server_mlp:   # [q; k; v] came with down_qkv
            q, k, v = half.split_rows(self._take(layer, "qkv", h))
        elif chunked:
            x = self._normalized(h).numpy()
            q, k, v = half.split_rows(torch.from_numpy(self._send_chunks(layer, "attn_qkv", x)))
        else:
            qkv = self._send(layer, "attn_qkv", half.input_rows(h), 1)
            q, k, v = half.split_qkv(half.decrypt([cts[0] for cts in qkv]))
        dtype = h.dtype if h.dtype.is_floating_point else torch.float32
        q, k, v = (t.to(dtype) for t in (q, k, v))
        u = backend.attend(layer, rope(q, positions), rope(k, positions), v)   # the client's own clear cache
        if self.fused is not None:   # o_up: [Wo u; W_gu (h + Wo u)], the second half for this layer's MLP
            y = self._send_fused(layer, "o_up", torch.cat([u.reshape(t, -1).double(), h.double()], -1))
            hidden = h.shape[-1]
            self.pending[("gate_up", layer)] = y[:, hidden:]
            return y[:, :hidden]
        if chunked:
            return torch.from_numpy(self._send_chunks(layer, "attn_o", u.reshape(t, -1).double().numpy()))
        outs = self._send(layer, "attn_o", half.mixture_rows(u.reshape(t, -1)), 1)
        return half.output(half.decrypt([cts[0] for cts in outs]))

    # -- fused steps ---------------------------------------------------------------------------------------
    def _fused_mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """A fused plan's MLP seam: h [T, hidden] (the residual after the attention) -> the MLP's output; the
        gate and up projections came with ``o_up``; ``down_qkv`` also brings the next layer's [q; k; v] (plain
        ``mlp_down`` after the last server layer of a run)."""
        lay = self.layout
        gu = self._take(layer, "gate_up", h)
        a = torch.nn.functional.silu(gu[:, :lay.intermediate]) * gu[:, lay.intermediate:]
        if layer + 1 not in self.info.server_attention_linear:
            return self._mlp_down(layer, a)
        y = self._send_fused(layer, "down_qkv", torch.cat([a, h.double()], -1))
        hidden = h.shape[-1]
        self.pending[("qkv", layer + 1)] = y[:, hidden:]
        return y[:, :hidden]

    def _take(self, layer: int, what: str, h: torch.Tensor) -> torch.Tensor:
        """The kept half of a fused answer for ``layer`` (unnormalized: W (x) for the residual x = h), scaled by
        the client's ``rsqrt(mean(h²) + eps)`` -> float64 [T, n]."""
        y = self.pending.pop((what, layer), None)
        if y is None or y.shape[0] != h.shape[0]:
            raise PrivateModeError(f"layer {layer}: fused steps out of order (no {what} for these positions)")
        x = h.double()
        return y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rt.model.config.rms_norm_eps)

    def _send_fused(self, layer: int, part: str, xs: torch.Tensor) -> torch.Tensor:
        """xs [T, n_in] (float64: the value and the residual, concatenated) through the fused ``part`` ->
        y [T, n_out] (float64): the chunk layout for several positions, else one ciphertext per position in
        (``outputs`` out)."""
        if xs.shape[0] > 1 and self.chunks is not None:
            return torch.from_numpy(self._send_chunks(layer, part, xs.numpy()))
        import numpy as np

        from fhe.errors import ShapeError

        lay = self.fused[part]
        if not torch.isfinite(xs).all():
            raise PrivateModeError(f"layer {layer} {part}: cannot encrypt NaN/inf")
        vals = self._send(layer, part, [lay.pack(r) for r in xs.numpy()], lay.outputs, decrypt=True)
        try:
            return torch.from_numpy(np.stack([lay.unpack(vals[i:i + lay.outputs])
                                              for i in range(0, len(vals), lay.outputs)]))
        except ShapeError as exc:
            raise PrivateModeError(f"layer {layer} {part}: unusable server answer ({exc})") from exc

    def _normalized(self, h: torch.Tensor) -> torch.Tensor:
        """``h / rms(h)`` per row, float64, no gain (the server folds the gain into its weights)."""
        x = h.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rt.model.config.rms_norm_eps)

    def _send_chunks(self, layer: int, part: str, xs) -> Any:
        """xs [T, n_in] (float64) through a multi-position step of ``part`` in the chunk layout
        (:mod:`fhe.interleaved`: chunks of m positions, T tiles in and G ciphertexts out each) -> y [T, n_out]."""
        import numpy as np

        from fhe.errors import ShapeError

        sh, t = self.chunks[part], xs.shape[0]
        if not np.isfinite(xs).all():
            raise PrivateModeError(f"layer {layer} {part}: cannot encrypt NaN/inf")
        m = sh.positions
        rows = [v for c in range(0, t, m) for v in sh.pack(xs[c:c + m])]
        vals = self._send(layer, part, rows, 1, count=t, n_out=sh.groups * -(-t // m), decrypt=True)
        try:
            return np.concatenate([sh.unpack(vals[i * sh.groups:(i + 1) * sh.groups], min(m, t - c))
                                   for i, c in enumerate(range(0, t, m))])
        except ShapeError as exc:
            raise PrivateModeError(f"layer {layer} {part}: unusable server answer ({exc})") from exc

    def _crypto_pool(self, n: int) -> Any:
        """The forked crypto pool for a step of ``n`` ciphertexts, or None for the serial path (one ciphertext,
        or ``crypto_processes`` 1)."""
        procs = self.rt.crypto_processes
        if n < 2 or procs <= 1:
            return None
        if self.pool is None or self.pool.processes != procs:
            from client_sdk._crypto_pool import CryptoPool

            self.close_pool()
            self.pool = CryptoPool(self.ckks, procs, self.seeded)
        return self.pool

    def close_pool(self) -> None:
        """End the crypto pool's children (a new key set, or the runtime's end)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _send(self, layer: int, part: str, rows: list, per_position: int, count: int | None = None,
              n_out: int | None = None, decrypt: bool = False) -> list:
        """Encrypt ``rows`` (one per position, or the chunk rows of ``count`` positions), run the step,
        return the decryptable answers in groups of ``per_position`` (``n_out`` answers: default
        ``per_position`` per row); ``decrypt``: the answers' decrypted values instead, in order. A step of
        several ciphertexts encrypts (and, ``decrypt``, decrypts) over the forked crypto pool
        (``PrivateRuntime.crypto_processes``)."""
        from fhe import wire
        from fhe.errors import FHEError
        from fhe.fingerprint import params_hash

        session, stats = self.rt.session, self.rt.current_stats
        pool = self._crypto_pool(len(rows))
        blobs = (tuple(pool.encrypt(rows)) if pool is not None else
                 tuple(wire.encrypt_to_wire(self.ckks, r, seeded=self.seeded) for r in rows))
        call = session.mlp_call(layer, part, self.start, blobs, params_hash(self.params), count)
        t0 = time.perf_counter()
        reply = self.rt.exchange(call)
        stats.record(part, time.perf_counter() - t0, len(call.content), len(reply.content))
        n_out = per_position * len(rows) if n_out is None else n_out
        out = session.mlp_result(reply, layer, part, self.start, n_out)
        try:
            if decrypt:
                pool = self._crypto_pool(len(out))
                return (pool.decrypt(out) if pool is not None else
                        [self.ckks.decrypt(wire.load_ciphertext(b, self.ckks.kit, self.ckks.fingerprint))
                         for b in out])
            cts = [wire.load_ciphertext(b, self.ckks.kit, self.ckks.fingerprint) for b in out]
        except FHEError as exc:
            raise PrivateModeError(f"layer {layer} {part}: unusable server answer ({type(exc).__name__})") from exc
        return [cts[i:i + per_position] for i in range(0, len(cts), per_position)]


__all__ = ["EncryptedMLPSeam", "LinearAttentionSeam", "OffloadClient", "OffloadInfo", "OffloadSession"]
