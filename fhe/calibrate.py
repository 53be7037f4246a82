"""Fit FHE-friendly score maps to a checkpoint by block-wise distillation, and check their range.

Procedure (``cipherlm fhe calibrate``; see ``docs/approximations.md``):

1. calibration text: the model's own greedy answers to the shipped calibration prompts
   (``fhe/data/calibration_prompts.txt``, disjoint from the evaluation prompts);
2. one exact forward pass per sequence records, for each encrypted layer, the block input (the
   normalized residual times the gain) and the exact attention output (after ``o_proj``);
3. per layer, independently (block-wise, teacher inputs), Adam minimizes the relative MSE between the
   approximated block's output (exact normalization) and the exact one, over per-head scale and shift
   (``sqexp``, ``polyexp``) and, for ``2quad`` with ``distill_weights``, also Wq/Wk/Wv/Wo (and q/k/v biases);
   a penalty keeps ``|a s + b|`` inside the range the squarings tolerate;
4. the fitted range is measured on all calibration positions; ``bound = margin * max|a s + b|`` must fit
   (sqexp: ``bound <= 0.75 * 2^R``; polyexp: ``bound <= window``), else :class:`CalibrationError`
   names the layers that do not.

Everything is seeded and runs on CPU in minutes for SmolLM2.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.model import DenseKVCache, LlamaForCausalLM, apply_rope
from fhe.approx import POLY_HI, POLY_WINDOW, SQEXP_MAX_BOUND_FRACTION, ScoreApprox, score_map
from fhe.plan import LayerPlan, Plan, PlanError, model_fingerprint

DATA_DIR = Path(__file__).parent / "data"


class CalibrationError(PlanError):
    """Calibration could not produce a usable plan (e.g. a layer's score range does not fit)."""


@dataclass(frozen=True)
class CalibrationConfig:
    """What to fit and how.

    Attributes:
        layers: encrypted layer indices.
        kind: ``"sqexp"``, ``"polyexp"`` or ``"2quad"``.
        squarings: R for sqexp (squarings) and polyexp (depth: degree 2^R - 1).
        fit: False = uncalibrated (range statistics only: sqexp a=1, b=-max score; 2quad a=1, b=c).
        distill_weights: also fit Wq/Wk/Wv/Wo (2quad only; the plan then carries the weights).
        steps: Adam steps per layer.
        lr: learning rate of scale/shift (weights use ``weight_lr``).
        weight_lr: learning rate of the distilled weights.
        margin: bound = margin * observed max |a s + b|.
        quad_shift: 2Quad's uncalibrated c in (s + c)^2 (MPCFormer uses 5).
        min_denominator: sqexp: penalize rows whose denominator z falls below this (0 = off); a small z
            amplifies CKKS noise in the client's division.
        max_x: sqexp: penalize a s + b above this (p = (1+x/2^R)^(2^R) must fit CKKS headroom);
            polyexp uses at most ``POLY_HI`` (the top of its window).
        window: polyexp: P approximates exp on [-window, POLY_HI]; the fitted bound must stay inside.
        num_prompts: calibration prompts used (from the shipped list).
        max_new_tokens: tokens the model generates per prompt.
        seed: torch seed (generation is greedy; this seeds the optimizer's world).
    """

    layers: tuple[int, ...]
    kind: str = "sqexp"
    squarings: int = 6
    fit: bool = True
    distill_weights: bool = False
    steps: int = 150
    lr: float = 0.03
    weight_lr: float = 2e-4
    margin: float = 1.25
    quad_shift: float = 5.0
    min_denominator: float = 0.0
    max_x: float = 10.0
    num_prompts: int = 32
    max_new_tokens: int = 24
    seed: int = 0
    window: float = POLY_WINDOW

    def __post_init__(self) -> None:
        if self.kind not in ("sqexp", "2quad", "polyexp"):
            raise ValueError(f"calibration fits sqexp, polyexp or 2quad, not {self.kind!r}")
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"layers must be distinct non-negative indices, got {self.layers}")
        if self.distill_weights and self.kind != "2quad":
            raise ValueError("weight distillation is only for 2quad")
        if self.margin < 1.0 or self.steps < 0 or self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("margin >= 1, steps >= 0, num_prompts >= 1, max_new_tokens >= 1")

    @property
    def max_bound(self) -> float:
        """Largest bound the kind tolerates (sqexp: the base 1 + x/2^R stays clearly positive;
        polyexp: x stays inside the polynomial's window)."""
        if self.kind == "polyexp":
            return self.window
        return SQEXP_MAX_BOUND_FRACTION * 2 ** self.squarings if self.kind == "sqexp" else math.inf

    @property
    def approx_window(self) -> float:
        """The window a ScoreApprox of this kind carries (0 unless polyexp)."""
        return self.window if self.kind == "polyexp" else 0.0

    @property
    def x_ceiling(self) -> float:
        """Largest a s + b the fit may reach without a penalty."""
        return min(self.max_x, POLY_HI) if self.kind == "polyexp" else self.max_x


def load_prompts(name: str) -> list[str]:
    """A shipped prompt list: ``"calibration"`` or ``"evaluation"`` (comments and blanks dropped)."""
    lines = (DATA_DIR / f"{name}_prompts.txt").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def chat_corpus(model: LlamaForCausalLM, tokenizer, prompts: list[str], max_new_tokens: int,
                batch_size: int = 16) -> list[list[int]]:
    """Each prompt in the chat template followed by the model's own greedy answer (token ids)."""
    from fhe.simulator import batched_greedy

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else None
    seqs = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in batch]
        seqs += [p + a for p, a in zip(ids, batched_greedy(model, ids, max_new_tokens, eos), strict=True)]
    return seqs


def calibration_corpus(model: LlamaForCausalLM, tokenizer, cfg: CalibrationConfig) -> list[list[int]]:
    """The model's answers to the first ``cfg.num_prompts`` shipped calibration prompts."""
    prompts = load_prompts("calibration")[:cfg.num_prompts]
    return chat_corpus(model, tokenizer, prompts, cfg.max_new_tokens)


@dataclass
class LayerData:
    """Padded block inputs and targets of one layer.

    x [B, T, hidden] = gain * normalize(residual); target [B, T, hidden] = exact attention output;
    valid [B, T] marks real (non-padding) positions. Padding sits at the end, so causality masks it.
    """

    x: torch.Tensor
    target: torch.Tensor
    valid: torch.Tensor


@torch.no_grad()  # not inference_mode: distillation differentiates through these inputs
def collect(model: LlamaForCausalLM, seqs: list[list[int]], layers: tuple[int, ...]) -> dict[int, LayerData]:
    """One exact pass per sequence; records each listed layer's block input and exact output."""
    t_max, hidden = max(map(len, seqs)), model.config.hidden_size
    out = {i: LayerData(torch.zeros(len(seqs), t_max, hidden), torch.zeros(len(seqs), t_max, hidden),
                        torch.zeros(len(seqs), t_max, dtype=torch.bool)) for i in layers}
    for b, ids in enumerate(seqs):
        t, pos = len(ids), torch.arange(len(ids))
        cache, h = DenseKVCache(model.config, t), model.embed(torch.tensor(ids))
        for i, layer in enumerate(model.layers[:max(layers) + 1]):
            if i in out:
                x = layer.input_layernorm(h)
                out[i].x[b, :t], out[i].valid[b, :t] = x.float(), True
                out[i].target[b, :t] = layer.self_attn(x, pos, model.rotary, cache).float()
            h = layer(h, pos, model.rotary, cache)
    return out


class BlockFit(nn.Module):
    """A differentiable copy of one attention block with score map parameters (batched [B, T])."""

    def __init__(self, model: LlamaForCausalLM, index: int, init: ScoreApprox, train_weights: bool) -> None:
        super().__init__()
        attn = model.layers[index].self_attn
        self.hq, self.hkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.kind, self.squarings, self.rotary = init.kind, init.squarings, model.rotary
        self.window = init.window
        self.scale = nn.Parameter(torch.tensor(init.scale))
        self.shift = nn.Parameter(torch.tensor(init.shift))
        self.proj = nn.ModuleDict({n: _copy_linear(getattr(attn, n), train_weights)
                                   for n in ("q_proj", "k_proj", "v_proj", "o_proj")})

    def affine(self, x: torch.Tensor):
        """x [B, T, hidden] -> a s + b [B, Hq, T, T], v [B, T, Hkv, D], causal mask [T, T]."""
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(torch.arange(t))
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)                   # [B*T, D]
        q = apply_rope(self.proj["q_proj"](x).view(b * t, self.hq, self.d), cos, sin)
        k = apply_rope(self.proj["k_proj"](x).view(b * t, self.hkv, self.d), cos, sin)
        q, k = q.view(b, t, self.hq, self.d), k.view(b, t, self.hkv, self.d)
        v = self.proj["v_proj"](x).view(b, t, self.hkv, self.d)
        k = k.repeat_interleave(self.hq // self.hkv, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        return s, v, mask

    def forward(self, x: torch.Tensor, cached=None, clamp: bool = False):
        """x [B, T, hidden] -> (out [B, T, hidden], s [B, Hq, T, T], mask [T, T], z [B, Hq, T]).

        ``cached`` = ``self.affine(x)`` may be passed when the projections are frozen; ``clamp``: see
        :func:`fhe.approx.score_map` (the optimizer's steps only, never the measurement).
        """
        s, v, mask = self.affine(x) if cached is None else cached
        p = score_map(s, self.kind, self.scale, self.shift, self.squarings, mask, self.window, clamp)
        vh = v.repeat_interleave(self.hq // self.hkv, dim=2)            # [B, T, Hq, D]
        z = p.sum(-1)                                                   # [B, Hq, T]
        pv = torch.einsum("bhqk,bkhd->bqhd", p, vh) / z.transpose(1, 2)[..., None]
        return self.proj["o_proj"](pv.flatten(2)), s, mask, z

    def output_extent(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
        """(max z, max over heads h and outputs o of |(sum_j p_hj v_j / z_h) Wo_h[o]|) on valid positions."""
        s, v, mask = self.affine(x)
        p = score_map(s, self.kind, self.scale, self.shift, self.squarings, mask, self.window)
        z = p.sum(-1)                                                   # [B, Hq, T]
        vh = v.repeat_interleave(self.hq // self.hkv, dim=2)
        pv = torch.einsum("bhqk,bkhd->bqhd", p, vh) / z.transpose(1, 2)[..., None]   # [B, T, Hq, D]
        wo = self.proj["o_proj"].weight.view(-1, self.hq, self.d)       # [hidden, Hq, D]
        y = torch.einsum("nhd,ohd->nho", pv[valid], wo)                # [positions, Hq, hidden]
        return float(z.transpose(1, 2)[valid].max()), float(y.abs().max())

    def x_range(self, s: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """a s + b on real, unmasked entries (flat)."""
        x = self.scale[:, None, None] * s + self.shift[:, None, None]
        keep = (~mask)[None, None] & valid[:, None, :, None] & valid[:, None, None, :]
        return x[keep.expand_as(x)]


def _copy_linear(lin: nn.Linear, trainable: bool) -> nn.Linear:
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    new.load_state_dict(lin.state_dict())
    new.requires_grad_(trainable)
    return new


def rel_mse(out: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean squared error over valid positions, relative to the target's mean square."""
    m = valid[..., None].float()
    return ((out - target) ** 2 * m).sum() / ((target ** 2) * m).sum()


@torch.no_grad()
def score_extremes_per_head(model: LlamaForCausalLM, index: int, data: LayerData):
    """(max, min) exact score s per query head over the calibration positions, each [Hq]."""
    fit = BlockFit(model, index, ScoreApprox.exact(model.config.num_attention_heads), False)
    s, _, mask = fit.affine(data.x)
    keep = (~mask)[None, None] & data.valid[:, None, :, None] & data.valid[:, None, None, :]
    return (s.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3)),
            s.masked_fill(~keep, math.inf).amin(dim=(0, 2, 3)))


def initial_approx(model: LlamaForCausalLM, index: int, data: LayerData,
                   cfg: CalibrationConfig) -> ScoreApprox:
    """The uncalibrated map: sqexp/polyexp a=1, b=-max score (x <= 0 on calibration data); 2quad a=1, b=c."""
    hq = model.config.num_attention_heads
    exp_like = cfg.kind in ("sqexp", "polyexp")
    scale = torch.ones(hq)
    if exp_like:
        hi, lo = score_extremes_per_head(model, index, data)
        shift = -hi
        if cfg.kind == "polyexp":  # start inside the window: outside it P is far from exp
            scale = (0.9 * cfg.window / cfg.margin / (hi - lo).clamp_min(1e-6)).clamp(max=1.0)
            shift = -scale * hi
    else:
        shift = torch.full((hq,), cfg.quad_shift)
    placeholder = cfg.max_bound if exp_like else 1.0
    return ScoreApprox(cfg.kind, tuple(scale.tolist()), tuple(shift.tolist()), cfg.squarings, placeholder,
                       cfg.approx_window)


def fit_layer(model: LlamaForCausalLM, index: int, data: LayerData, cfg: CalibrationConfig):
    """Fit (or only measure) one layer. Returns (LayerPlan, info dict)."""
    init = initial_approx(model, index, data, cfg)
    fit = BlockFit(model, index, init, cfg.distill_weights)
    start, losses = time.perf_counter(), []
    if cfg.fit and cfg.steps:
        losses = _optimize(fit, data, cfg)
    with torch.no_grad():
        out, s, mask, z = fit(data.x)
        loss = float(rel_mse(out, data.target, data.valid))
        x = fit.x_range(s, mask, data.valid)
        min_z = float(z.transpose(1, 2)[data.valid].min())
        extent = fit.output_extent(data.x, data.valid)
    lo, hi = float(x.min()), float(x.max())
    bound = cfg.margin * max(abs(lo), abs(hi))
    info = {"layer": index, "rel_mse_initial": losses[0] if losses else loss, "rel_mse": loss,
            "observed_range": [lo, hi], "bound": bound, "min_denominator": min_z,
            "observed_output": list(extent),
            "fits": bound <= cfg.max_bound, "seconds": round(time.perf_counter() - start, 2)}
    if not info["fits"]:
        return None, info
    approx = ScoreApprox(cfg.kind, tuple(fit.scale.tolist()), tuple(fit.shift.tolist()), cfg.squarings, bound,
                         cfg.approx_window)
    weights = _adjusted_weights(fit) if cfg.distill_weights else {}
    return LayerPlan(index, approx, (lo, hi), weights, extent), info


def _optimize(fit: BlockFit, data: LayerData, cfg: CalibrationConfig) -> list[float]:
    """Adam on relative MSE + range penalty; returns the loss per step."""
    groups = [{"params": [fit.scale, fit.shift], "lr": cfg.lr}]
    if cfg.distill_weights:
        groups.append({"params": list(fit.proj.parameters()), "lr": cfg.weight_lr})
    opt = torch.optim.Adam(groups)
    cap = 0.9 * cfg.max_bound / cfg.margin
    cached = None
    if not cfg.distill_weights:
        with torch.no_grad():
            cached = fit.affine(data.x)
    losses = []
    for _ in range(cfg.steps):
        out, s, mask, z = fit(data.x, cached, clamp=True)
        loss = rel_mse(out, data.target, data.valid)
        total = loss + _range_penalty(fit.x_range(s, mask, data.valid), cap, cfg)
        if cfg.min_denominator > 0:
            zv = z.transpose(1, 2)[data.valid]                          # [N, Hq]
            total = total + torch.relu(math.log(cfg.min_denominator) - zv.log()).pow(2).mean()
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _range_penalty(x: torch.Tensor, cap: float, cfg: CalibrationConfig) -> torch.Tensor:
    """Mean squared excess of |x| over ``cap`` and of x over ``cfg.x_ceiling`` (sqexp, polyexp)."""
    if not math.isfinite(cap):
        return x.new_zeros(())
    return torch.relu(x.abs() - cap).pow(2).mean() + torch.relu(x - cfg.x_ceiling).pow(2).mean()


def _adjusted_weights(fit: BlockFit) -> dict[str, torch.Tensor]:
    return {f"{n}.{p}": t.detach().clone() for n, lin in fit.proj.items() for p, t in lin.named_parameters()}


def calibrate(model: LlamaForCausalLM, tokenizer, cfg: CalibrationConfig, model_id: str,
              ckks: dict | None = None, corpus: list[list[int]] | None = None, log=print) -> Plan:
    """Generate calibration text, fit every layer of ``cfg.layers``, return the plan.

    Args:
        ckks: CKKS parameters to record (default: ``fhe.params.ckks_params_for`` the kind and R).
        corpus: calibration token sequences (default: :func:`calibration_corpus`).

    Raises:
        CalibrationError: a layer's fitted score range does not fit (named in the message).
    """
    if max(cfg.layers) >= len(model.layers):
        raise CalibrationError(f"layers {cfg.layers} out of range: the model has {len(model.layers)}")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    seqs = corpus if corpus is not None else calibration_corpus(model, tokenizer, cfg)
    data = collect(model, seqs, cfg.layers)
    log(f"calibration text: {len(seqs)} sequences, {sum(map(len, seqs))} positions "
        f"({time.perf_counter() - t0:.1f} s)")
    layer_plans, infos = [], []
    for index in cfg.layers:
        lp, info = fit_layer(model, index, data[index], cfg)
        log(_describe(info))
        layer_plans.append(lp)
        infos.append(info)
    bad = [i["layer"] for i in infos if not i["fits"]]
    if bad:
        raise CalibrationError(f"score range of layers {bad} does not fit {cfg.kind} with R={cfg.squarings} "
                               f"(bound must be <= {cfg.max_bound:g}); encrypt other layers or raise R")
    meta = {"kind": cfg.kind, "fit": cfg.fit, "distill_weights": cfg.distill_weights, "steps": cfg.steps,
            "min_denominator_target": cfg.min_denominator, "max_x": cfg.x_ceiling,
            "seed": cfg.seed, "margin": cfg.margin, "num_sequences": len(seqs),
            "num_positions": sum(map(len, seqs)), "max_new_tokens": cfg.max_new_tokens,
            "prompts": "fhe/data/calibration_prompts.txt",
            # no timings: the same inputs give the same plan hash
            "layers": [{k: v for k, v in i.items() if k != "seconds"} for i in infos]}
    ckks = ckks_params_dict(cfg.kind, cfg.squarings) if ckks is None else ckks
    return Plan(model_id, model_fingerprint(model), tuple(layer_plans), ckks, _created_by(), meta)


def ckks_params_dict(kind: str, squarings: int) -> dict:
    """The CKKS parameter set the encrypted block needs for this approximation (``fhe.params``)."""
    from fhe.params import ckks_params_for

    return ckks_params_for(kind, squarings).to_dict()


def _describe(info: dict) -> str:
    lo, hi = info["observed_range"]
    return (f"layer {info['layer']}: rel. MSE {info['rel_mse_initial']:.4g} -> {info['rel_mse']:.4g}, "
            f"a*s+b in [{lo:.2f}, {hi:.2f}], bound {info['bound']:.2f}, min z {info['min_denominator']:.3g}"
            f"{'' if info['fits'] else '  DOES NOT FIT'} ({info['seconds']} s)")


def _created_by() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"cipherlm {version('cipherlm')} fhe calibrate"
    except PackageNotFoundError:
        return "cipherlm fhe calibrate"
