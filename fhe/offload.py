"""Offload plans: where every part of every layer runs, and how each non-linearity is handled.

An :class:`OffloadPlan` places, per decoder layer, the attention block and the MLP block on the
``client`` (in the clear) or on the ``server`` (on ciphertexts), and for each server-side part names how
its non-linearity is handled:

* attention ``softmax``: ``approx`` — the calibrated score map of the attention plan (:class:`fhe.plan.Plan`,
  named by its content hash: sqexp today) with exact normalization on the client, the server holding an
  encrypted KV cache; or ``client`` — client-aided attention as linear steps (:mod:`fhe.offload_attention`):
  the server computes ``[q; k; v]`` and, later, ``Wo u`` on ciphertexts; the client applies RoPE, keeps the
  layer's K/V cache in the clear and computes the exact softmax attention ``u`` in between (one more round
  trip per layer, no approximation; q·k and p·v run on the client);
* MLP ``silu``: ``client`` — client-aided (:mod:`fhe.mlp`: the server returns the encrypted gate and up
  projections, the client computes ``silu(g) * u`` exactly and re-encrypts it for the down projection);
  or ``poly`` — a calibrated polynomial SiLU on the server (:mod:`fhe.silu`, coefficients in the plan).

The RMSNorms are always client-aided: the client holds the residual stream, so it normalizes before
each server-side part and adds each part's decrypted output back. The embedding, the final norm and the
head always stay on the client (the text exists only there). The plan also carries the model's config, so
its costs (:func:`cost_report`) need no weights.

On disk: one canonical JSON document (``format = cipherlm-offload-plan``) with ``content_hash`` =
SHA-256 of the RFC 8785 canonical JSON of everything else; :meth:`OffloadPlan.load` checks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import rfc8785

from engine.config import ModelConfig
from fhe.errors import FHEError, ParameterError
from fhe.plan import Plan
from fhe.silu import SiluPoly

FORMAT = "cipherlm-offload-plan"
FORMAT_VERSION = 1
CLIENT, SERVER = "client", "server"
SOFTMAX_CHOICES = ("approx", "client")
SILU_CHOICES = ("client", "poly")
DEFAULT_OFFLOAD_FILE = "smollm2-135m-instruct.offload.json"


class OffloadPlanError(FHEError, ValueError):
    """An offload plan is malformed, fails its hash, or does not fit the model or its attention plan."""


@dataclass(frozen=True)
class LayerPlacement:
    """Where one decoder layer's two blocks run.

    Attributes:
        index: the layer.
        attention, mlp: ``client`` or ``server``.
        softmax: for a server attention block, ``approx`` or ``client`` (None on the client).
        silu: for a server MLP block, ``client`` or ``poly`` (None on the client).
    """

    index: int
    attention: str = CLIENT
    mlp: str = CLIENT
    softmax: str | None = None
    silu: str | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise OffloadPlanError(f"negative layer index {self.index}")
        for part, choice, allowed in (("attention", self.softmax, SOFTMAX_CHOICES), ("mlp", self.silu, SILU_CHOICES)):
            place = getattr(self, part)
            if place not in (CLIENT, SERVER):
                raise OffloadPlanError(f"layer {self.index}: {part} must run on client or server, not {place!r}")
            if place == SERVER and choice not in allowed:
                raise OffloadPlanError(f"layer {self.index}: server {part} needs one of {allowed}, got {choice!r}")
            if place == CLIENT and choice is not None:
                raise OffloadPlanError(f"layer {self.index}: a client-side {part} has no server non-linearity")

    @property
    def round_trips(self) -> int:
        """Client <-> server exchanges this layer costs per token."""
        att = 0 if self.attention == CLIENT else (2 if self.softmax == CLIENT else 1)
        mlp = 0 if self.mlp == CLIENT else (2 if self.silu == CLIENT else 1)
        return att + mlp

    def to_dict(self) -> dict:
        return {"index": self.index, "attention": self.attention, "mlp": self.mlp,
                "softmax": self.softmax, "silu": self.silu}


@dataclass(frozen=True, eq=False)
class OffloadPlan:
    """The placement of every part of a model (see the module docstring).

    Attributes:
        model_id: human-readable model name.
        config: the model's Hugging Face config dict (shapes for the costs; checked against the model).
        layers: one placement per decoder layer, by index 0..L-1.
        attention_plan_hash: content hash of the :class:`Plan` with the score maps of every server
            attention block whose softmax is ``approx`` (None if there is none).
        silu: per layer with ``silu = poly``, its fitted polynomial.
    """

    model_id: str
    config: Mapping
    layers: tuple[LayerPlacement, ...]
    attention_plan_hash: str | None = None
    silu: Mapping[int, SiluPoly] = field(default_factory=dict)
    created_by: str = "cipherlm"
    #: fused linear steps (:mod:`fhe.offload_fused`): two round trips per server layer instead of four
    fused: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted(self.layers, key=lambda p: p.index)))
        cfg = self.model_config
        if [p.index for p in self.layers] != list(range(cfg.num_hidden_layers)):
            raise OffloadPlanError(f"need one placement per layer 0..{cfg.num_hidden_layers - 1}")
        need = {p.index for p in self.layers if p.silu == "poly"}
        if set(self.silu) != need:
            raise OffloadPlanError(f"SiLU polynomials for layers {sorted(self.silu)}, poly layers are {sorted(need)}")
        if self.approx_layers and not self.attention_plan_hash:
            raise OffloadPlanError("approximated attention needs the attention plan's hash")
        if self.fused:
            self._check_fused(cfg)

    def _check_fused(self, cfg: ModelConfig) -> None:
        """Fused steps need every server layer wholly linear steps (attention and MLP on the server, softmax
        and SiLU client-aided) and a model without q/k/v biases (:mod:`fhe.offload_fused`)."""
        bad = [p.index for p in self.layers if (p.attention == SERVER or p.mlp == SERVER)
               and (p.attention, p.mlp, p.softmax, p.silu) != (SERVER, SERVER, "client", "client")]
        if bad:
            raise OffloadPlanError(f"fused steps need attention and MLP of every server layer on the server, "
                                   f"softmax and SiLU client-aided; layers {bad} are not")
        if cfg.attention_bias:
            raise OffloadPlanError("fused steps need a model without q/k/v biases (they do not commute with the "
                                   "client's RMS scaling)")

    @property
    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_hf_dict(dict(self.config))
        except (KeyError, TypeError, ValueError) as exc:
            raise OffloadPlanError(f"bad model config in offload plan: {exc}") from exc

    @property
    def server_attention(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.layers if p.attention == SERVER)

    @property
    def server_mlp(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.layers if p.mlp == SERVER)

    @property
    def approx_layers(self) -> tuple[int, ...]:
        """Server attention layers that use the attention plan's calibrated score map."""
        return tuple(p.index for p in self.layers if p.softmax == "approx")

    @property
    def round_trips(self) -> int:
        """Exchanges per decoded token."""
        if self.fused:
            return len(self.linear_steps())
        return sum(p.round_trips for p in self.layers)

    def linear_steps(self) -> tuple[tuple[int, str], ...]:
        """Per token, the (layer, part) of every linear step in the order the client sends them: four per
        layer (``attn_qkv``, ``attn_o``, ``mlp_up``, ``mlp_down`` where that part runs as a linear step), or,
        fused, :func:`fhe.offload_fused.fused_step_order`."""
        if self.fused:
            from fhe.offload_fused import fused_step_order

            return fused_step_order(self.server_mlp)
        out: list[tuple[int, str]] = []
        for p in self.layers:
            if p.attention == SERVER and p.softmax == "client":
                out += [(p.index, "attn_qkv"), (p.index, "attn_o")]
            if p.mlp == SERVER:
                out += [(p.index, "mlp_up"), (p.index, "mlp_down")]
        return tuple(out)

    def check_attention_plan(self, plan: Plan | None) -> None:
        """OffloadPlanError unless ``plan`` is the named attention plan and covers every approx layer."""
        if not self.approx_layers:
            return
        if plan is None or plan.content_hash != self.attention_plan_hash:
            raise OffloadPlanError("the attention plan is not the one this offload plan names")
        missing = set(self.approx_layers) - set(plan.layer_indices)
        if missing:
            raise OffloadPlanError(f"attention plan has no score map for layers {sorted(missing)}")

    def metadata(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "model_id": self.model_id,
                "config": dict(self.config), "layers": [p.to_dict() for p in self.layers],
                "attention_plan_hash": self.attention_plan_hash, "created_by": self.created_by,
                "silu": {str(i): s.to_dict() for i, s in sorted(self.silu.items())},
                # only when on: an unfused plan's content (and hash) is what it was before fused steps
                **({"fused": True} if self.fused else {})}

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(rfc8785.dumps(self.metadata())).hexdigest()

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        doc = {**self.metadata(), "content_hash": self.content_hash}
        path.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> OffloadPlan:
        """Read and verify a plan written by :meth:`save` (OffloadPlanError on any problem)."""
        try:
            doc = json.loads(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise OffloadPlanError(f"{path}: not a readable offload plan ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise OffloadPlanError(f"{path}: not a version-{FORMAT_VERSION} {FORMAT}")
        claimed = doc.pop("content_hash", None)
        plan = _from_doc(doc)
        if claimed != plan.content_hash:
            raise OffloadPlanError(f"{path}: content hash mismatch (modified or corrupted)")
        return plan


def _from_doc(doc: dict) -> OffloadPlan:
    try:
        layers = tuple(LayerPlacement(int(d["index"]), d["attention"], d["mlp"], d.get("softmax"), d.get("silu"))
                       for d in doc["layers"])
        silu = {int(i): SiluPoly.from_dict(s) for i, s in doc.get("silu", {}).items()}
        fused = doc.get("fused", False)
        if not isinstance(fused, bool):
            raise OffloadPlanError(f"fused must be true or false, not {fused!r}")
        return OffloadPlan(doc["model_id"], doc["config"], layers, doc.get("attention_plan_hash"), silu,
                           doc.get("created_by", "cipherlm"), fused)
    except (KeyError, TypeError, ValueError, ParameterError) as exc:
        if isinstance(exc, OffloadPlanError):
            raise
        raise OffloadPlanError(f"malformed offload plan: {exc!r}") from exc


def offload_plan(cfg: ModelConfig, model_id: str, client_layers: int = 2, *, softmax: str = "approx",
                 silu: str = "client", attention_plan_hash: str | None = None,
                 silu_polys: Mapping[int, SiluPoly] | None = None, fused: bool = False) -> OffloadPlan:
    """Layers ``[0, client_layers)`` on the client, every later attention and MLP block on the server
    (``fused``: as fused linear steps, :mod:`fhe.offload_fused`)."""
    layers = tuple(LayerPlacement(i) if i < client_layers else LayerPlacement(i, SERVER, SERVER, softmax, silu)
                   for i in range(cfg.num_hidden_layers))
    return OffloadPlan(model_id, cfg.to_hf_dict(), layers, attention_plan_hash, dict(silu_polys or {}),
                       fused=fused)


def with_fused(plan: OffloadPlan, fused: bool = True) -> OffloadPlan:
    """``plan`` with fused linear steps on (or off): the same placements, another content hash."""
    return OffloadPlan(plan.model_id, plan.config, plan.layers, plan.attention_plan_hash, plan.silu,
                       plan.created_by, fused)


def with_poly_silu(plan: OffloadPlan, polys: Mapping[int, SiluPoly]) -> OffloadPlan:
    """``plan`` with the polynomial SiLU on the server MLPs of ``polys`` (a per-layer choice: the others
    keep theirs, e.g. client-aided where no polynomial fits the layer's range well enough)."""
    bad = set(polys) - set(plan.server_mlp)
    if bad:
        raise OffloadPlanError(f"layers {sorted(bad)} have no server MLP")
    layers = tuple(LayerPlacement(p.index, p.attention, p.mlp, p.softmax, "poly") if p.index in polys else p
                   for p in plan.layers)
    silu = {**{i: s for i, s in plan.silu.items() if i not in polys}, **polys}
    return OffloadPlan(plan.model_id, plan.config, layers, plan.attention_plan_hash, silu, plan.created_by,
                       plan.fused)


def partial_plan(cfg: ModelConfig, plan: Plan) -> OffloadPlan:
    """The older partial plan as an offload plan: only ``plan``'s attention blocks on the server."""
    enc = set(plan.layer_indices)
    layers = tuple(LayerPlacement(i, SERVER, CLIENT, "approx") if i in enc else LayerPlacement(i)
                   for i in range(cfg.num_hidden_layers))
    return OffloadPlan(plan.model_id, cfg.to_hf_dict(), layers, plan.content_hash)


def default_offload_path() -> Path:
    """The shipped offload plan of the default model (layers 2-29 on the server, client-aided MLP)."""
    return Path(__file__).parent / "data" / DEFAULT_OFFLOAD_FILE


# --- costs ---------------------------------------------------------------------------------------------


def _attention_params(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    bias = d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) if cfg.attention_bias else 0
    return qkv + bias + cfg.num_attention_heads * d * h + h          # + o_proj + input norm gain


def _mlp_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size + cfg.hidden_size   # + post-attention norm gain


def _projection_macs(cfg: ModelConfig) -> int:
    """Per token: the q/k/v and output projections."""
    return cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)


def _score_macs(cfg: ModelConfig, context: int) -> int:
    """Per token: q.k and p.v over ``context`` keys."""
    return 2 * cfg.num_attention_heads * cfg.head_dim * context


def _server_attention_macs(cfg: ModelConfig, p: LayerPlacement, context: int) -> int:
    """What the server computes of a layer's attention: nothing on the client, the projections only when
    the softmax is client-aided (linear steps: q.k and p.v run on the client), everything with ``approx``."""
    if p.attention != SERVER:
        return 0
    return _projection_macs(cfg) + (_score_macs(cfg, context) if p.softmax == "approx" else 0)


@dataclass(frozen=True)
class CostReport:
    """Per-token multiply-adds and parameters, split by where they run.

    The embedding is a lookup (no multiply-adds); norms, RoPE, SiLU and the softmax are element-wise and
    left out of the multiply-adds (< 0.1 % of them for SmolLM2).
    """

    context: int
    server_macs: int
    client_macs: int
    server_params: int
    client_params: int
    round_trips: int

    @property
    def server_mac_share(self) -> float:
        return self.server_macs / (self.server_macs + self.client_macs)

    @property
    def client_param_share(self) -> float:
        return self.client_params / (self.server_params + self.client_params)

    def bundle_tensor_bytes(self, bytes_per_param: float = 4.0) -> int:
        """Bytes of the client's tensors at ``bytes_per_param`` (fp32: 4)."""
        return int(self.client_params * bytes_per_param)


def cost_report(plan: OffloadPlan, context: int = 64) -> CostReport:
    """The plan's split of work and weights for one token decoded at ``context`` keys (>= 1)."""
    if context < 1:
        raise OffloadPlanError(f"context must be >= 1, got {context}")
    cfg = plan.model_config
    att_p, mlp_p = _attention_params(cfg), _mlp_params(cfg)
    att_m, mlp_m = _projection_macs(cfg) + _score_macs(cfg, context), 3 * cfg.hidden_size * cfg.intermediate_size
    s_macs = s_params = 0
    for p in plan.layers:
        s_macs += _server_attention_macs(cfg, p, context) + (mlp_m if p.mlp == SERVER else 0)
        s_params += (att_p if p.attention == SERVER else 0) + (mlp_p if p.mlp == SERVER else 0)
    total_params = (cfg.num_hidden_layers * (att_p + mlp_p) + cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
                    + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size))
    total_macs = cfg.num_hidden_layers * (att_m + mlp_m) + cfg.vocab_size * cfg.hidden_size
    return CostReport(context, s_macs, total_macs - s_macs, s_params, total_params - s_params, plan.round_trips)


__all__ = ["CLIENT", "SERVER", "CostReport", "LayerPlacement", "OffloadPlan", "OffloadPlanError", "cost_report",
           "default_offload_path", "offload_plan", "partial_plan", "with_fused", "with_poly_silu"]
