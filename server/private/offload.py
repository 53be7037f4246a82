"""The offload plan's side of the encrypted-session service: linear steps, their key set, the manifest.

With ``[private] offload_plan`` set, the server runs, besides the calibrated attention blocks of its
attention plan (``[private] plan``; the offload plan's ``softmax = approx`` layers), the MLP blocks the
offload plan places on the server (:mod:`fhe.mlp`, client-aided SiLU) and its ``softmax = client``
attention blocks as two linear steps each (:mod:`fhe.offload_attention`). A session then holds two key
sets: the attention key (``key_id``) and the offload key (``mlp_key_id``, made for
:data:`fhe.mlp.MLP_PARAMS`), which runs every linear step, attention and MLP alike. Everything a step
can fail from its envelope is checked here, in the server process, before a worker parses a byte
(docs/protocol.md, "Offload steps"): a step of another part or layer, or under the wrong key set, is a
4xx with an OpenAI-style body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fhe import envelope
from fhe.backends import check_backend, describe
from fhe.errors import BackendMismatchError
from fhe.fingerprint import params_hash
from fhe.interleaved import ChunkShape
from fhe.mlp import MLP_PARAMS
from fhe.offload import OffloadPlan, OffloadPlanError
from fhe.offload_attention import AttentionLinearLayout, attention_geometry
from fhe.offload_fused import FUSED_PARTS, fused_geometry
from fhe.offload_steps import (
    LINEAR_PARTS,
    MLP_PARTS,
    chunk_layout_manifest,
    chunk_shapes,
    fresh_blob_limit,
    mlp_geometry,
    offload_rotation_steps,
    step_blobs,
)
from server.errors import InvalidRequestError, PermissionDeniedError, RequestTooLargeError


def check_fits(offload: OffloadPlan, attention_plan: Any, model_config: Any) -> None:
    """OffloadPlanError unless the service can run ``offload`` with ``attention_plan``: the same model
    shape, every ``softmax = approx`` layer calibrated in the attention plan (the others run as linear
    steps and need no score map), and no polynomial SiLU (not wired)."""
    if offload.model_config.to_hf_dict() != model_config.to_hf_dict():
        raise OffloadPlanError("the offload plan was made for another model shape")
    calibrated = attention_plan.layer_indices if attention_plan is not None else ()   # None: linear steps only
    missing = set(offload.approx_layers) - set(calibrated)
    if missing:
        raise OffloadPlanError(f"layers {sorted(missing)} approximate the softmax (softmax = approx) but the "
                               "attention plan has no score map for them; make them softmax = client")
    if offload.approx_layers:
        offload.check_attention_plan(attention_plan)
    if offload.silu:
        raise OffloadPlanError("the polynomial SiLU is not wired into the service; use silu = client")


def linear_attention_layers(plan: OffloadPlan) -> tuple[int, ...]:
    """Server attention layers run as linear steps (``softmax = client``)."""
    return tuple(p.index for p in plan.layers if p.attention == "server" and p.softmax == "client")


@dataclass
class OffloadSteps:
    """What the service checks for an offload plan's linear steps (stateless: no per-session server state
    but the offload key lease).

    Attributes:
        plan: the offload plan.
        layers: layers whose MLP runs on the server.
        blob_limit: bytes of one fresh offload ciphertext (the per-blob limit of every linear part).
        attention_layers: layers whose attention runs as linear steps (``attn_qkv``, ``attn_o``).
        attention_layout: their layout (from the plan's model shape).
        chunks: per part, the chunk layout of a step of >= 2 positions (:mod:`fhe.interleaved`); None where
            the deployment turned it off (``[private] offload_chunk_layout = false``): such a step then carries
            one ciphertext per position, as a decode step does, and the workers hold 8x fewer plaintexts.
        full_uploads: the workers evaluate on the gpu backend and read full (unseeded) uploads straight into
            device tensors: the manifest then asks for them (``offload.mlp.upload = "full"``); seeded uploads
            are still taken (through SEAL). False (SEAL workers): the manifest is what it was, seeded uploads.
        steps: every (layer, part) the plan runs as a linear step (:meth:`fhe.offload.OffloadPlan.linear_steps`:
            four parts per layer, or a fused plan's ``attn_qkv`` / ``o_up`` / ``down_qkv`` / ``mlp_down``).
    """

    plan: OffloadPlan
    layers: tuple[int, ...]
    blob_limit: int
    attention_layers: tuple[int, ...] = ()
    attention_layout: AttentionLinearLayout | None = None
    chunks: dict[str, ChunkShape] | None = None
    full_uploads: bool = False
    steps: frozenset[tuple[int, str]] = frozenset()

    def __post_init__(self) -> None:
        if not self.steps:
            self.steps = frozenset(self.plan.linear_steps())

    @classmethod
    def of(cls, plan: OffloadPlan, chunks: bool = True, full_uploads: bool = False) -> OffloadSteps:
        return cls(plan, plan.server_mlp, fresh_blob_limit(MLP_PARAMS), linear_attention_layers(plan),
                   attention_geometry(plan.model_config, MLP_PARAMS)[0],
                   chunk_shapes(plan.model_config, MLP_PARAMS, fused=plan.fused) if chunks else None, full_uploads)

    def blobs(self, part: str, count: int) -> tuple[int, int]:
        """(ciphertexts in, ciphertexts out) of a step of ``part`` over ``count`` positions: one position is one
        ciphertext in (``mlp_up``: ``outputs_per_position`` out); more run the chunk layout, or, without it,
        one ciphertext in per position (the first figure is the one checked)."""
        if count <= 1:
            return 1, 1
        if self.chunks is None:
            return count, count
        return step_blobs(self.chunks[part], count)

    def max_inputs(self, count: int) -> int:
        """The most ciphertexts a legal step of at most ``count`` positions carries (any part this server
        runs): the envelope bound a server with ``max_step_tokens = count`` must accept."""
        return max((self.blobs(part, count)[0] for part in {p for _, p in self.steps}), default=1)

    @staticmethod
    def packed(env: envelope.Envelope, chunk_layout: bool = True) -> bool:
        """Whether a checked step runs the chunk layout (any linear part over >= 2 positions, where the
        deployment runs the layout: ``[private] offload_chunk_layout``)."""
        return chunk_layout and env.positions[1] > 1

    def check_open(self, mlp_key_id: str | None) -> None:
        if (self.layers or self.attention_layers) and mlp_key_id is None:
            raise InvalidRequestError("this server runs linear offload steps: open the session with mlp_key_id, "
                                      "a key registered for the offload parameters (manifest: offload.mlp)",
                                      code="mlp_key_required")

    @staticmethod
    def check_mlp_key(record: Any) -> None:
        """The registered key named as ``mlp_key_id`` must be made for the MLP's parameters."""
        if record.params_hash != params_hash(MLP_PARAMS):
            raise InvalidRequestError(f"key {record.key_id!r} was not made for the MLP's parameters "
                                      "(manifest: offload.mlp.ckks)", code="wrong_key_set")

    def check_step(self, s: Any, env: envelope.Envelope, cfg: Any) -> None:
        """Every check of a linear step (MLP or attention) that needs no ciphertext parsing (4xx on failure)."""
        start, count = env.positions
        if env.session != s.id:
            raise InvalidRequestError("envelope names another session", code="session_mismatch")
        if env.part not in LINEAR_PARTS:
            raise InvalidRequestError(f"part must be one of {envelope.PARTS}", code="bad_part")
        if (env.layer, env.part) not in self.steps:
            self._refuse_layer(env)
        self._check_key(s, env)
        if env.kind not in ("prefill", "decode") or not 1 <= count <= cfg.max_step_tokens:
            raise InvalidRequestError(f"a linear step carries 1..{cfg.max_step_tokens} positions", code="bad_step")
        want, _ = self.blobs(env.part, count)
        if len(env.blobs) != want:
            raise InvalidRequestError(f"{count} positions of {env.part} are {want} ciphertexts (manifest: "
                                      f"offload.mlp.chunk_layout), got {len(env.blobs)}", code="bad_step")
        if start + count > cfg.max_session_tokens:
            raise RequestTooLargeError(f"session limit of {cfg.max_session_tokens} positions", code="session_full")
        if any(len(b) > self.blob_limit for b in env.blobs):
            raise RequestTooLargeError(f"an {env.part} ciphertext is at most {self.blob_limit} bytes",
                                       code="step_too_large")

    def _refuse_layer(self, env: envelope.Envelope) -> None:
        """400 ``bad_layer``: the plan runs no such step (another layer, or a fused plan's step on an unfused
        server and the other way round)."""
        if self.plan.fused or env.part in FUSED_PARTS:
            kind = "fused" if self.plan.fused else "unfused (four steps per layer)"
            raise InvalidRequestError(f"layer {env.layer} runs no {env.part} step: this server's plan is {kind} "
                                      "(manifest: offload.fused)", code="bad_layer")
        what, layers = (("MLP", self.layers) if env.part in MLP_PARTS else
                        ("attention run as linear steps", self.attention_layers))
        raise InvalidRequestError(f"layer {env.layer} has no server {what} in this plan {list(layers)}",
                                  code="bad_layer")

    @staticmethod
    def _check_key(s: Any, env: envelope.Envelope) -> None:
        if env.key_fingerprint == s.fingerprint:
            raise InvalidRequestError("linear steps run under the session's offload key set, not its attention key",
                                      code="wrong_key_set")
        if env.key_fingerprint != s.mlp_fingerprint:
            raise PermissionDeniedError("key fingerprint does not match the session's offload key",
                                        code="key_mismatch")
        try:
            check_backend(env.backend, env.params, name="seal", params=MLP_PARAMS)
        except BackendMismatchError as exc:
            raise InvalidRequestError(str(exc), code="backend_mismatch") from exc

    def manifest(self, model_config: Any) -> dict:
        """The manifest's ``offload`` section: the plan, its hash, and the offload key set (``mlp``, the name
        it had when only MLPs ran there): parameters, Galois steps (the union of every linear part's)."""
        layout, _ = mlp_geometry(model_config, MLP_PARAMS)
        fused = self.plan.fused
        steps = offload_rotation_steps(model_config, MLP_PARAMS, attention=bool(self.attention_layers),
                                       mlp=bool(self.layers), chunks=self.chunks is not None, fused=fused)
        outputs = {"mlp_up": len(layout.up_slots), "mlp_down": 1, "attn_qkv": 1, "attn_o": 1}
        if fused:
            outputs |= {p: lay.outputs for p, lay in fused_geometry(model_config, MLP_PARAMS)[0].items()}
        return {"plan_hash": self.plan.content_hash, "plan": self.plan.metadata(),
                # only on a fused plan: an unfused server's manifest is what it was (older SDKs read it)
                **({"fused": True} if fused else {}),
                "server_attention": list(self.plan.server_attention), "server_mlp": list(self.layers),
                "server_attention_linear": list(self.attention_layers),
                "round_trips_per_token": self.plan.round_trips,
                "mlp": {"ckks": MLP_PARAMS.to_dict(), "backend": describe(MLP_PARAMS),
                        "rotation_steps": list(steps), "outputs_per_position": outputs,
                        "chunk_layout": chunk_layout_manifest(self.chunks),
                        "max_blob_bytes": self.blob_limit,
                        **({"upload": "full"} if self.full_uploads else {})}}


__all__ = ["OffloadSteps", "check_fits", "linear_attention_layers"]
