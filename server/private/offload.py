"""The offload plan's side of the encrypted-session service: MLP steps, their key set, the manifest.

With ``[private] offload_plan`` set, the server runs, besides the attention blocks of its attention plan
(``[private] plan``), the MLP blocks the offload plan places on the server (:mod:`fhe.mlp`, client-aided
SiLU). A session then holds two key sets: the attention key (``key_id``) and the MLP key
(``mlp_key_id``, made for :data:`fhe.mlp.MLP_PARAMS`). Everything a step can fail from its envelope
is checked here, in the server process, before a worker parses a byte (docs/protocol.md, "Offload
steps"): a step of another part or layer, or under the wrong key set, is a 4xx with an OpenAI-style body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fhe import envelope
from fhe.backends import check_backend, describe
from fhe.errors import BackendMismatchError
from fhe.fingerprint import params_hash
from fhe.mlp import MLP_PARAMS
from fhe.offload import OffloadPlan, OffloadPlanError
from fhe.offload_steps import MLP_PARTS, fresh_blob_limit, mlp_geometry
from server.errors import InvalidRequestError, PermissionDeniedError, RequestTooLargeError


def check_fits(offload: OffloadPlan, attention_plan: Any, model_config: Any) -> None:
    """OffloadPlanError unless the service can run ``offload`` with ``attention_plan``: the same model
    shape, every server attention layer calibrated in the attention plan (``softmax = approx``: the
    client-aided softmax has no encrypted form yet), and no polynomial SiLU (not wired)."""
    if offload.model_config.to_hf_dict() != model_config.to_hf_dict():
        raise OffloadPlanError("the offload plan was made for another model shape")
    if set(offload.server_attention) != set(attention_plan.layer_indices):
        raise OffloadPlanError(f"the offload plan's server attention layers {list(offload.server_attention)} "
                               f"are not the attention plan's {list(attention_plan.layer_indices)}")
    client_softmax = [p.index for p in offload.layers if p.softmax == "client"]
    if client_softmax:
        raise OffloadPlanError(f"layers {client_softmax}: the client-aided softmax has no encrypted form yet; "
                               "use an attention plan that calibrates them (softmax = approx)")
    offload.check_attention_plan(attention_plan)
    if offload.silu:
        raise OffloadPlanError("the polynomial SiLU is not wired into the service; use silu = client")


@dataclass
class OffloadSteps:
    """What the service checks for an offload plan's MLP steps (stateless: no per-session server state
    but the MLP key lease).

    Attributes:
        plan: the offload plan.
        layers: layers whose MLP runs on the server.
        blob_limit: bytes of one fresh MLP ciphertext (the per-blob limit of both parts).
    """

    plan: OffloadPlan
    layers: tuple[int, ...]
    blob_limit: int

    @classmethod
    def of(cls, plan: OffloadPlan) -> OffloadSteps:
        return cls(plan, plan.server_mlp, fresh_blob_limit(MLP_PARAMS))

    def check_open(self, mlp_key_id: str | None) -> None:
        if self.layers and mlp_key_id is None:
            raise InvalidRequestError("this server runs MLP blocks: open the session with mlp_key_id, a key "
                                      "registered for the MLP's parameters (manifest: offload.mlp)",
                                      code="mlp_key_required")

    @staticmethod
    def check_mlp_key(record: Any) -> None:
        """The registered key named as ``mlp_key_id`` must be made for the MLP's parameters."""
        if record.params_hash != params_hash(MLP_PARAMS):
            raise InvalidRequestError(f"key {record.key_id!r} was not made for the MLP's parameters "
                                      "(manifest: offload.mlp.ckks)", code="wrong_key_set")

    def check_step(self, s: Any, env: envelope.Envelope, cfg: Any) -> None:
        """Every check of an MLP step that needs no ciphertext parsing (4xx on failure)."""
        start, count = env.positions
        if env.session != s.id:
            raise InvalidRequestError("envelope names another session", code="session_mismatch")
        if env.part not in MLP_PARTS:
            raise InvalidRequestError(f"part must be one of {envelope.PARTS}", code="bad_part")
        if env.layer not in self.layers:
            raise InvalidRequestError(f"layer {env.layer} has no server MLP in this plan {list(self.layers)}",
                                      code="bad_layer")
        self._check_key(s, env)
        if env.kind not in ("prefill", "decode") or not 1 <= count <= cfg.max_step_tokens:
            raise InvalidRequestError(f"an MLP step carries 1..{cfg.max_step_tokens} positions, one ciphertext "
                                      "each (no packed form)", code="bad_step")
        if len(env.blobs) != count:
            raise InvalidRequestError(f"{count} positions but {len(env.blobs)} ciphertexts", code="bad_step")
        if start + count > cfg.max_session_tokens:
            raise RequestTooLargeError(f"session limit of {cfg.max_session_tokens} positions", code="session_full")
        if any(len(b) > self.blob_limit for b in env.blobs):
            raise RequestTooLargeError(f"an {env.part} ciphertext is at most {self.blob_limit} bytes",
                                       code="step_too_large")

    @staticmethod
    def _check_key(s: Any, env: envelope.Envelope) -> None:
        if env.key_fingerprint == s.fingerprint:
            raise InvalidRequestError("MLP steps run under the session's MLP key set, not its attention key",
                                      code="wrong_key_set")
        if env.key_fingerprint != s.mlp_fingerprint:
            raise PermissionDeniedError("key fingerprint does not match the session's MLP key", code="key_mismatch")
        try:
            check_backend(env.backend, env.params, name="seal", params=MLP_PARAMS)
        except BackendMismatchError as exc:
            raise InvalidRequestError(str(exc), code="backend_mismatch") from exc

    def manifest(self, model_config: Any) -> dict:
        """The manifest's ``offload`` section: the plan, its hash, the MLP's parameters and Galois steps."""
        layout, steps = mlp_geometry(model_config, MLP_PARAMS)
        return {"plan_hash": self.plan.content_hash, "plan": self.plan.metadata(),
                "server_attention": list(self.plan.server_attention), "server_mlp": list(self.layers),
                "round_trips_per_token": self.plan.round_trips,
                "mlp": {"ckks": MLP_PARAMS.to_dict(), "backend": describe(MLP_PARAMS),
                        "rotation_steps": list(steps), "outputs_per_position": {"mlp_up": len(layout.up_slots),
                                                                                "mlp_down": 1},
                        "max_blob_bytes": self.blob_limit}}


__all__ = ["OffloadSteps", "check_fits"]
