"""The FHE plan: which layers run encrypted, how, and with which CKKS parameters.

A :class:`Plan` is a versioned, content-hashed artifact written by ``cipherlm fhe calibrate``:

* the model it was fitted to (id + SHA-256 of its weights, see :func:`model_fingerprint`),
* per encrypted layer: its :class:`~fhe.approx.ScoreApprox`, the observed range of ``a s + b`` on
  calibration text, and optionally adjusted attention weights (distilled 2Quad),
* the CKKS parameters the depth of the approximation needs, who created it, calibration metadata.

On disk it is either one canonical-JSON file (``*.json``, only when no weights are adjusted) or a folder
with ``plan.json`` and ``weights.safetensors``. ``plan.json`` holds the metadata, a manifest of the
tensors (dtype, shape, SHA-256 of their bytes) and ``content_hash`` = SHA-256 of the RFC 8785 canonical
JSON of everything else, so the hash covers every number and every tensor byte. :meth:`Plan.load`
checks the format, the version, the hash and each tensor and raises :class:`PlanError` on any mismatch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import rfc8785
import torch

from fhe.approx import ScoreApprox
from fhe.errors import FHEError

FORMAT = "cipherlm-fhe-plan"
FORMAT_VERSION = 1
PLAN_JSON = "plan.json"
WEIGHTS_FILE = "weights.safetensors"
DEFAULT_PLAN_FILE = "smollm2-135m-instruct.plan.json"
#: The shipped plans by name: the default (sqexp R=6, depth 11, N = 32768) and ``polyexp`` (a degree-31
#: exp at depth 10, N = 32768: closer to the model, 17 % smaller keys, a 23 % slower decode step; see
#: docs/benchmarks.md "polyexp"), an option (``[private] plan = ...``, ``plan-info polyexp``).
#: ``n16384``: the same polyexp fit (identical layers and calibration record) at depth 9, N = 16384, with
#: p * V folded into P (docs/fhe.md §3c): 3x smaller uploads and keys (docs/benchmarks.md "depth 9").
SHIPPED_PLANS = {"default": DEFAULT_PLAN_FILE, "polyexp": "smollm2-135m-instruct-polyexp.plan.json",
                 "n16384": "smollm2-135m-instruct-n16384.plan.json"}
#: adjusted weights a plan may carry, relative to ``layers[i].self_attn``
ADJUSTABLE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
              "q_proj.bias", "k_proj.bias", "v_proj.bias")


class PlanError(FHEError, ValueError):
    """A plan file is malformed, of another format version, fails its hash, or does not fit the model."""


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """One encrypted layer.

    Attributes:
        index: the decoder layer's index.
        approx: its score map.
        observed_range: (min, max) of ``a s + b`` over the calibration positions, if measured.
        weights: adjusted attention weights by name (``ADJUSTABLE``), HF layout, gain not folded.
        observed_output: (max z, max |y_h / z_h|) over the calibration positions, if measured: the
            largest denominator (in the score map's own units) and the
            largest per-head normalized output ``(sum_j p_j v_j / z) Wo_h``; the encrypted block sizes
            its values from these (with a margin) instead of from worst-case bounds.
    """

    index: int
    approx: ScoreApprox
    observed_range: tuple[float, float] | None = None
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)
    observed_output: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise PlanError(f"negative layer index {self.index}")
        bad = set(self.weights) - set(ADJUSTABLE)
        if bad:
            raise PlanError(f"layer {self.index}: cannot adjust {sorted(bad)}")

    def to_dict(self) -> dict:
        rng = None if self.observed_range is None else [float(v) for v in self.observed_range]
        out = {"index": self.index, "approx": self.approx.to_dict(), "observed_range": rng}
        if self.observed_output is not None:
            out["observed_output"] = [float(v) for v in self.observed_output]
        return out


@dataclass(frozen=True, eq=False)
class Plan:
    """A calibrated FHE plan (see the module docstring).

    Attributes:
        model_id: a human-readable model name (e.g. ``SmolLM2-135M-Instruct``).
        weights_sha256: :func:`model_fingerprint` of the model it was fitted to.
        layers: the encrypted layers, by increasing index.
        ckks: CKKS parameters (``fhe.params``), as a JSON-ready dict.
        created_by: tool and version that wrote it.
        calibration: free-form JSON metadata (data, steps, losses, seed).
        format_version: on-disk format version.
    """

    model_id: str
    weights_sha256: str
    layers: tuple[LayerPlan, ...]
    ckks: Mapping = field(default_factory=dict)
    created_by: str = "cipherlm"
    calibration: Mapping = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted(self.layers, key=lambda lp: lp.index)))
        idx = [lp.index for lp in self.layers]
        if len(set(idx)) != len(idx):
            raise PlanError(f"duplicate layer indices {idx}")
        if self.format_version != FORMAT_VERSION:
            raise PlanError(f"plan format version {self.format_version}, this build reads {FORMAT_VERSION}")

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """Indices of the encrypted layers."""
        return tuple(lp.index for lp in self.layers)

    def layer(self, index: int) -> LayerPlan:
        """The plan of layer ``index`` (PlanError if it is not encrypted)."""
        for lp in self.layers:
            if lp.index == index:
                return lp
        raise PlanError(f"layer {index} is not in the plan (encrypted: {self.layer_indices})")

    def tensors(self) -> dict[str, torch.Tensor]:
        """All adjusted weights, flat: ``layers.{i}.{name}``."""
        return {f"layers.{lp.index}.{n}": t.detach().contiguous().cpu()
                for lp in self.layers for n, t in sorted(lp.weights.items())}

    def metadata(self) -> dict:
        """Everything the hash covers, JSON-ready (tensors by manifest)."""
        return {"format": FORMAT, "format_version": self.format_version,
                "model": {"id": self.model_id, "weights_sha256": self.weights_sha256},
                "layers": [lp.to_dict() for lp in self.layers], "ckks": dict(self.ckks),
                "created_by": self.created_by, "calibration": dict(self.calibration),
                "tensors": {n: tensor_entry(t) for n, t in self.tensors().items()}}

    @property
    def content_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of :meth:`metadata`."""
        return _hash_metadata(self.metadata())

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise PlanError unless ``model`` has the weights the plan was fitted to and its layers."""
        if model_fingerprint(model) != self.weights_sha256:
            raise PlanError("the plan was fitted to other model weights (weights SHA-256 mismatch)")
        n = len(model.layers)
        if any(i >= n for i in self.layer_indices):
            raise PlanError(f"plan encrypts layers {self.layer_indices}, the model has {n}")

    def save(self, path: str | Path) -> Path:
        """Write to ``path``: a single ``.json`` file (no adjusted weights) or a folder. Returns the path."""
        path = Path(path)
        meta = self.metadata()
        doc = {**meta, "content_hash": _hash_metadata(meta)}
        if path.suffix == ".json":
            if meta["tensors"]:
                raise PlanError("a plan with adjusted weights must be saved as a folder, not a .json file")
            path.write_bytes(_pretty(doc))
            return path
        path.mkdir(parents=True, exist_ok=True)
        if meta["tensors"]:
            from safetensors.torch import save_file

            save_file(self.tensors(), str(path / WEIGHTS_FILE))
        (path / PLAN_JSON).write_bytes(_pretty(doc))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read and verify a plan written by :meth:`save` (PlanError on any problem)."""
        path = Path(path)
        meta_file = path / PLAN_JSON if path.is_dir() else path
        doc = _read_json(meta_file)
        claimed = doc.pop("content_hash", None)
        _check_header(doc)
        if claimed != _hash_metadata(doc):
            raise PlanError(f"{meta_file}: content hash mismatch (the plan was modified or corrupted)")
        tensors = _load_tensors(path, doc["tensors"]) if doc["tensors"] else {}
        return _from_doc(doc, tensors)


def default_plan_path() -> Path:
    """The shipped default plan for the default model (SmolLM2-135M-Instruct, layers 2-5)."""
    return shipped_plan_path("default")


def shipped_plan_path(name: str) -> Path:
    """A shipped plan by name (:data:`SHIPPED_PLANS`); PlanError for an unknown name."""
    if name not in SHIPPED_PLANS:
        raise PlanError(f"no shipped plan {name!r} (shipped: {sorted(SHIPPED_PLANS)})")
    return Path(__file__).parent / "data" / SHIPPED_PLANS[name]


def load_default_plan() -> Plan:
    """:meth:`Plan.load` of :func:`default_plan_path`."""
    return Plan.load(default_plan_path())


def tensor_entry(t: torch.Tensor) -> dict:
    """Manifest entry of a tensor: dtype, shape and SHA-256 of its raw bytes."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's contiguous raw bytes."""
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over the model's state dict: sorted names, dtypes, shapes and raw bytes.

    Independent of the file format the weights came from (safetensors or GGUF) once loaded.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _hash_metadata(meta: dict) -> str:
    try:
        return hashlib.sha256(rfc8785.dumps(meta)).hexdigest()
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise PlanError(f"plan metadata is not canonical JSON: {exc}") from exc


def _pretty(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise PlanError(f"no plan at {path}") from exc
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: not a readable JSON plan ({exc})") from exc
    if not isinstance(doc, dict):
        raise PlanError(f"{path}: a plan is a JSON object")
    return doc


def _check_header(doc: dict) -> None:
    if doc.get("format") != FORMAT:
        raise PlanError(f"not a cipherlm plan (format {doc.get('format')!r})")
    if doc.get("format_version") != FORMAT_VERSION:
        raise PlanError(f"plan format version {doc.get('format_version')!r}, "
                        f"this build reads {FORMAT_VERSION}")


def _load_tensors(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path / WEIGHTS_FILE)) if path.is_dir() else {}
    except (OSError, SafetensorError) as exc:
        raise PlanError(f"{path / WEIGHTS_FILE}: unreadable ({exc})") from exc
    if set(tensors) != set(manifest):
        raise PlanError("the weights file does not hold the tensors the plan lists")
    for name, t in tensors.items():
        if tensor_entry(t) != manifest[name]:
            raise PlanError(f"tensor {name} does not match its manifest entry (hash, dtype or shape)")
    return tensors


def _from_doc(doc: dict, tensors: dict[str, torch.Tensor]) -> Plan:
    try:
        layers = tuple(_layer_from_dict(d, tensors) for d in doc["layers"])
        return Plan(doc["model"]["id"], doc["model"]["weights_sha256"], layers, doc["ckks"],
                    doc["created_by"], doc["calibration"], doc["format_version"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"malformed plan: {exc!r}") from exc


def _layer_from_dict(d: dict, tensors: dict[str, torch.Tensor]) -> LayerPlan:
    prefix = f"layers.{d['index']}."
    weights = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
    rng, out = (_pair(d.get(key), key) for key in ("observed_range", "observed_output"))
    if out is not None and not all(v > 0 for v in out):
        raise PlanError("observed output bounds must be positive")
    return LayerPlan(int(d["index"]), ScoreApprox.from_dict(d["approx"]), rng, weights, out)


def _pair(value, what: str) -> tuple[float, float] | None:
    """A finite (a, b) from a plan document, or None."""
    if value is None:
        return None
    pair = (float(value[0]), float(value[1]))
    if not all(math.isfinite(v) for v in pair):
        raise PlanError(f"{what.replace('_', ' ')} must be finite")
    return pair
