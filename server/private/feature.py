"""Start and stop the encrypted-session service with the app (audit log, key registry, workers, bundle).

State lives under ``private.state_dir`` (default ``$CIPHERLM_HOME/server``)::

    secrets.json            0600: key-storage and pseudonym keys (created on first start)
    audit-signing/          Ed25519 checkpoint signing key (``cipherlm audit keygen`` or first start)
    audit/audit.log         the tamper-evident audit log (+ .checkpoints)
    keys/registry.json      key registry state;  keys/material/  integrity-bound evaluation keys
    bundles/<plan>.safetensors   client bundles, built once per (model, plan)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from server.audit import AuditConfig, AuditLog, Event, Outcome, Pseudonymizer, SigningKeyDir, SigningKeyError
from server.keys import EvalKeyStorage, KeyRegistry, RegistryConfig
from server.private.backend import PoolCollector, make_pool
from server.private.config import PrivateSettings
from server.private.service import PrivateService

log = logging.getLogger("cipherlm.private")
MANIFEST_FORMAT = "cipherlm-private-manifest"
MANIFEST_VERSION = 1
SWEEP_EVERY_S = 15.0
#: what each worker process runs (``module:function``, imported by name in the worker)
WORKER_FACTORY = "server.private.compute:make_state"


def state_dir(cfg: PrivateSettings) -> Path:
    if cfg.state_dir:
        return Path(cfg.state_dir)
    from engine.default_model import cipherlm_home

    return cipherlm_home() / "server"


def _secrets(root: Path) -> dict[str, bytes]:
    """The operator secrets file, created 0600 on first start."""
    path = root / "secrets.json"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"storage_key": secrets.token_hex(32), "pseudonym_key": secrets.token_hex(32)}, fh)
    raw = json.loads(path.read_text())
    return {k: bytes.fromhex(v) for k, v in raw.items()}


def open_audit(root: Path, pseudonym_key: bytes, checkpoint_every: int) -> AuditLog:
    """The server's audit log (signing key created on first start)."""
    keys = SigningKeyDir(root / "audit-signing")
    try:
        signer = keys.load()
    except SigningKeyError:
        signer = keys.create()
        log.warning("created the audit signing key in %s; publish it with "
                    "`cipherlm audit publish-key --key-dir %s`", root / "audit-signing", root / "audit-signing")
    (root / "audit").mkdir(parents=True, exist_ok=True)
    return AuditLog.open(AuditConfig(root / "audit" / "audit.log", checkpoint_every=checkpoint_every),
                         signer, Pseudonymizer(pseudonym_key))


def default_plan_path() -> Path:
    """The plan shipped for the default model."""
    import fhe

    return Path(fhe.__file__).resolve().parent / "data" / "smollm2-135m-instruct.plan.json"


def check_plan(model_dir: Path, plan: Any) -> None:
    """PlanError unless ``plan`` was fitted to the weights in ``model_dir`` (hash of the weights)."""
    from engine.loader import load_model

    plan.check_model(load_model(model_dir))


def build_bundle(model_dir: Path, plan: Any, root: Path) -> tuple[Path, dict]:
    """The client bundle for (model, plan), built once and cached; returns (path, description)."""
    from engine.loader import load_model
    from fhe.bundle import write_bundle

    path = root / "bundles" / f"{plan.content_hash}.safetensors"
    desc_path = path.with_suffix(".json")
    if not path.exists() or not desc_path.exists():
        model = load_model(model_dir)
        tmp = path.with_suffix(".partial")
        desc = write_bundle(model, model_dir, plan.layer_indices, plan.content_hash, tmp)
        desc["sha256"] = hashlib.sha256(tmp.read_bytes()).hexdigest()
        desc["size"] = tmp.stat().st_size
        tmp.rename(path)
        desc_path.write_text(json.dumps(desc))
    return path, json.loads(desc_path.read_text())


def build_manifest(model_name: str, plan: Any, bundle: dict, cfg: PrivateSettings, num_layers: int) -> dict:
    """What a client needs to know before it generates keys and opens sessions."""
    from fhe.backends import describe
    from fhe.params import CKKSParams

    enc = list(plan.layer_indices)
    # attention steps go in SEAL's seeded form (half the bytes; docs/protocol.md "upload"): SEAL workers load them,
    # gpu workers (CUDA and the torch-CPU reference) expand c1 on the device (fhe.backends.gpu.uniform)
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "model": model_name,
            "model_sha256": plan.weights_sha256, "plan_hash": plan.content_hash,
            "plan": plan.metadata(), "ckks": dict(plan.ckks), "backend": describe(CKKSParams.from_dict(plan.ckks)),
            "layers": {"total": num_layers, "encrypted_attention": enc,
                       "client": [i for i in range(num_layers)]},
            "bundle": {"sha256": bundle["sha256"], "size": bundle["size"], "withheld": bundle["withheld"],
                       "path": "/v1/private/bundle"},
            "limits": {"max_session_tokens": cfg.max_session_tokens, "max_step_tokens": cfg.max_step_tokens,
                       "max_blob_bytes": cfg.max_blob_bytes, "max_step_bytes": cfg.max_step_bytes,
                       "max_key_bytes": cfg.max_key_bytes, "session_ttl_s": cfg.session_ttl_s,
                       "verify_steps": True}}


class AuditFallbackRecorder:
    """Writes each plaintext fallback of an encrypted tenant to the audit log."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def record_fallback(self, event: Any) -> None:
        self.audit.append(Event.PLAINTEXT_FALLBACK, source="server.policy", outcome=Outcome.SUCCESS,
                          tenant=event.tenant_id, actor=event.tenant_id, request_id=event.request_id,
                          detail={"endpoint": event.endpoint, "reason": event.reason})


def _worker_args(cfg: PrivateSettings, model_dir: Path, plan_path: Path | None) -> tuple:
    """The worker factory's arguments. The optional trailing ones (step_processes, offload_plan,
    offload_chunk_layout, offload_warm_graphs when off, packed_plain_cache_gb as bytes on a gpu backend) go only
    when set, so factories written for the first four keep working; step_processes only for local workers:
    a Ray actor's process runs Ray's own threads, which a fork per step would copy mid-flight. ``plan_path``
    None: an offload plan of linear steps only (the workers build no attention block)."""
    args: tuple = (str(model_dir), None if plan_path is None else str(plan_path), cfg.max_session_tokens,
                   cfg.device)
    split = cfg.step_processes if cfg.backend == "local" else 1
    kept = int(cfg.packed_plain_cache_gb * (1 << 30)) if cfg.gpu_backend and plan_path is not None else 0
    if kept:
        return args + (split, cfg.offload_plan, cfg.offload_chunk_layout, cfg.offload_warm_graphs, kept)
    if cfg.offload_plan:
        tail = (cfg.offload_chunk_layout, False) if not cfg.offload_warm_graphs else (
            () if cfg.offload_chunk_layout else (False,))
        return args + (split, cfg.offload_plan) + tail
    return args + ((split,) if split != 1 else ())


def _load_offload(cfg: PrivateSettings) -> Any:
    """The ``[private] offload_plan`` (None when unset)."""
    if not cfg.offload_plan:
        return None
    from fhe.offload import OffloadPlan

    return OffloadPlan.load(cfg.offload_plan)


def linear_only(offload: Any) -> bool:
    """Whether an offload plan's server layers are all linear steps (no ``softmax = approx`` layer): its
    sessions need no attention key, and the service no ``[private] plan``."""
    return offload is not None and not offload.approx_layers


async def start(app: Any) -> None:
    """Bring the private service up on ``app.state`` (called from the app's lifespan)."""
    settings = app.state.settings
    cfg: PrivateSettings = settings.private
    if not settings.private_enabled():
        return
    from engine.default_model import default_model_dir

    model_dir = Path(settings.model) if settings.model else default_model_dir()
    offload_plan = _load_offload(cfg)
    if linear_only(offload_plan):
        await _start_linear(app, cfg, model_dir, offload_plan)
    else:
        await _start_attention(app, cfg, model_dir)


async def _start_attention(app: Any, cfg: PrivateSettings, model_dir: Path) -> None:
    """The attention plan's service (``[private] plan``), with its offload plan's linear steps if one is set."""
    from engine.config import ModelConfig
    from fhe.backends import DEFAULT_BACKEND
    from fhe.geometry import packed_chunk_for
    from fhe.params import CKKSParams
    from fhe.plan import Plan, PlanError

    settings = app.state.settings
    plan_path = Path(cfg.plan) if cfg.plan else default_plan_path()
    try:
        plan = Plan.load(plan_path)
        await asyncio.to_thread(check_plan, model_dir, plan)
    except (PlanError, OSError) as exc:
        if cfg.enabled:  # asked for explicitly: a misfit is fatal
            raise
        log.error("encrypted sessions disabled: plan %s does not fit model %s: %s", plan_path, model_dir, exc)
        return
    try:
        cfg = with_device_key_cap(cfg, json.loads((model_dir / "config.json").read_text()), plan)
    except ValueError as exc:
        if settings.private.enabled:
            raise
        log.error("encrypted sessions disabled: %s", exc)
        return
    if cfg.offload_plan and cfg.max_keys_per_worker < 2:
        raise ValueError("an offload plan with calibrated attention layers loads two key sets per session "
                         "(attention and offload) into a worker: [private] max_keys_per_worker must be >= 2 "
                         f"(it is {cfg.max_keys_per_worker}, after device_key_bytes)")
    root = state_dir(cfg)
    _open_state(app, cfg, root)
    bundle_path, bundle = await asyncio.to_thread(build_bundle, model_dir, plan, root)
    cfg_json = json.loads((model_dir / "config.json").read_text())
    app.state.private_manifest = build_manifest(app.state.metrics.model_name, plan, bundle, cfg,
                                                cfg_json["num_hidden_layers"])
    app.state.private_bundle_path = bundle_path
    offload = await _offload(app, cfg, model_dir, plan, root)
    # with an offload plan, attention steps run only its calibrated (softmax = approx) layers
    attention_layers = offload.plan.approx_layers if offload is not None else plan.layer_indices
    svc = await _serve(app, cfg, root, plan.content_hash, attention_layers, _worker_args(cfg, model_dir, plan_path))
    svc.backend_name, svc.backend_params = DEFAULT_BACKEND, CKKSParams.from_dict(plan.ckks)
    svc.packed_chunk = packed_chunk_for(ModelConfig.from_hf_dict(cfg_json), svc.backend_params)
    svc.offload = offload
    app.state.private_manifest["limits"]["packed_chunk"] = svc.packed_chunk


async def _start_linear(app: Any, cfg: PrivateSettings, model_dir: Path, offload_plan: Any) -> None:
    """An offload plan of linear steps only: no attention plan is loaded, no attention key is made or held
    (``[private] plan``, if set, is not used), the workers build only the linear blocks."""
    from engine.config import ModelConfig
    from server.private.offload import OffloadSteps, check_fits

    if cfg.plan:
        log.info("[private] plan is not used: every server layer of the offload plan is a linear step")
    mcfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    check_fits(offload_plan, None, mcfg)
    root = state_dir(cfg)
    _open_state(app, cfg, root)
    steps = OffloadSteps.of(offload_plan, cfg.offload_chunk_layout, cfg.gpu_backend)
    path, desc = await asyncio.to_thread(build_offload_bundle, model_dir, offload_plan, root)
    app.state.private_manifest = build_linear_manifest(app.state.metrics.model_name, steps, mcfg, desc, cfg)
    app.state.private_bundle_path = path
    svc = await _serve(app, cfg, root, offload_plan.content_hash, (), _worker_args(cfg, model_dir, None))
    svc.offload = steps


def _open_state(app: Any, cfg: PrivateSettings, root: Path) -> None:
    """The audit log (and its fallback recorder) under the state folder."""
    keys = _secrets(root)
    audit = open_audit(root, keys["pseudonym_key"], cfg.audit_checkpoint_every)
    app.state.audit = audit
    app.state.private_storage_key = keys["storage_key"]
    app.state.fallback_recorders.append(AuditFallbackRecorder(audit))


async def _serve(app: Any, cfg: PrivateSettings, root: Path, plan_hash: str, attention_layers: tuple,
                 worker_args: tuple) -> PrivateService:
    """Workers, key registry and the service on ``app.state``, with its metrics and sweeper."""
    audit = app.state.audit
    pool = make_pool(cfg, WORKER_FACTORY, worker_args)
    registry = KeyRegistry(
        RegistryConfig(max_upload_bytes=cfg.max_key_bytes, default_lifetime_s=cfg.key_lifetime_s,
                       state_path=root / "keys" / "registry.json"),
        audit, EvalKeyStorage(root / "keys" / "material", app.state.private_storage_key))
    pool.batch_limit = cfg.batch_steps if cfg.gpu_backend else 1   # the local pool batches; Ray ignores it
    await pool.start()
    svc = PrivateService(cfg, plan_hash, attention_layers, pool, registry, audit)
    pool.in_use = lambda worker: bool(svc.sessions.on_worker(worker))  # never idle-stop a session's worker
    svc.observe_stages = app.state.metrics.record_private_stages
    app.state.private = svc
    app.state.private_metrics = PoolCollector(pool, cfg.backend, lambda w: len(svc.sessions.on_worker(w)))
    app.state.metrics.registry.register(app.state.private_metrics)
    app.state.private_sweeper = asyncio.create_task(_sweep_forever(svc))
    return svc


async def _offload(app: Any, cfg: PrivateSettings, model_dir: Path, plan: Any, root: Path):
    """With ``[private] offload_plan``: check it fits (a misfit is fatal: it was asked for), publish it in
    the manifest and serve the offload bundle (only the client's parts) instead of the partial plan's."""
    if not cfg.offload_plan:
        return None
    from engine.config import ModelConfig
    from server.private.offload import OffloadSteps, check_fits

    offload = _load_offload(cfg)
    mcfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    check_fits(offload, plan, mcfg)
    steps = OffloadSteps.of(offload, cfg.offload_chunk_layout, cfg.gpu_backend)
    path, desc = await asyncio.to_thread(build_offload_bundle, model_dir, offload, root)
    man = app.state.private_manifest
    man["offload"] = {**steps.manifest(mcfg), "attention_key": True}
    # the SDK sends attention steps for these layers only; the others of the offload plan run as linear steps
    man["layers"]["encrypted_attention"] = list(offload.approx_layers)
    man["bundle"].update({"sha256": desc["sha256"], "size": desc["size"], "withheld": desc["withheld"]})
    app.state.private_bundle_path = path
    return steps


def build_linear_manifest(model_name: str, steps: Any, mcfg: Any, bundle: dict, cfg: PrivateSettings) -> dict:
    """The manifest of an offload plan of linear steps only: ``offload.attention_key`` is false (a session
    opens on the offload key set alone), ``plan_hash`` is the offload plan's, ``ckks`` the offload
    parameters (the only key set), no layer takes attention steps, no packed prefill. ``verify_steps`` is
    true: a speculative step's linear steps are ordinary multi-position steps and the client's clear K/V
    cache is the only one to roll back, so the deployment takes speculation (docs/protocol.md)."""
    offload = {**steps.manifest(mcfg), "attention_key": False}
    mlp = offload["mlp"]
    n = mcfg.num_hidden_layers
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "model": model_name, "model_sha256": None,
            "plan_hash": steps.plan.content_hash, "plan": steps.plan.metadata(), "ckks": dict(mlp["ckks"]),
            "backend": mlp["backend"],
            "layers": {"total": n, "encrypted_attention": [], "client": list(range(n))},
            "bundle": {"sha256": bundle["sha256"], "size": bundle["size"], "withheld": bundle["withheld"],
                       "path": "/v1/private/bundle"},
            "limits": {"max_session_tokens": cfg.max_session_tokens, "max_step_tokens": cfg.max_step_tokens,
                       "max_blob_bytes": cfg.max_blob_bytes, "max_step_bytes": cfg.max_step_bytes,
                       "max_key_bytes": cfg.max_key_bytes, "session_ttl_s": cfg.session_ttl_s,
                       "verify_steps": True, "packed_chunk": 0},
            "offload": offload}


def build_offload_bundle(model_dir: Path, offload: Any, root: Path) -> tuple[Path, dict]:
    """The offload plan's client bundle (no tensor of a server part), built once and cached."""
    from engine.loader import load_model
    from fhe.bundle import write_offload_bundle

    path = root / "bundles" / f"offload-{offload.content_hash}.safetensors"
    desc_path = path.with_suffix(".json")
    if not path.exists() or not desc_path.exists():
        tmp = path.with_suffix(".partial")
        desc = write_offload_bundle(load_model(model_dir), model_dir, offload, tmp)
        desc["sha256"] = hashlib.sha256(tmp.read_bytes()).hexdigest()
        desc["size"] = tmp.stat().st_size
        tmp.rename(path)
        desc_path.write_text(json.dumps(desc))
    return path, json.loads(desc_path.read_text())


def with_device_key_cap(cfg: PrivateSettings, model_config: dict, plan) -> PrivateSettings:
    """``cfg`` with ``max_keys_per_worker`` lowered to the key sets that fit ``device_key_bytes`` (GPU workers
    keep each key set expanded on the device: its size is known from the plan before any key arrives).

    Raises:
        ValueError: the budget holds no key set at all.
    """
    if not cfg.gpu_backend or cfg.device_key_bytes is None:
        return cfg
    from engine.config import ModelConfig
    from fhe.backends.gpu.keys import key_set_nbytes
    from fhe.params import CKKSParams, KeyLevels
    from fhe.weight_maps import required_key_levels

    mcfg, params = ModelConfig.from_hf_dict(model_config), CKKSParams.from_dict(plan.ckks)
    levels = [required_key_levels(mcfg, params, lp.approx.kind, lp.approx.squarings) for lp in plan.layers]
    per_set = key_set_nbytes(params, functools.reduce(KeyLevels.merge, levels))
    fits = cfg.device_key_bytes // per_set
    if fits < 1:
        raise ValueError(f"[private] device_key_bytes = {cfg.device_key_bytes} holds no key set of this plan "
                         f"({per_set} bytes on the device)")
    return cfg.model_copy(update={"max_keys_per_worker": min(cfg.max_keys_per_worker, fits)})


async def _sweep_forever(svc: PrivateService) -> None:
    while True:
        await asyncio.sleep(SWEEP_EVERY_S)
        try:
            await svc.sweep()
        except Exception:  # noqa: BLE001 - a failed sweep must not end the sweeper
            log.exception("private session sweep failed")


async def stop(app: Any) -> None:
    """Stop workers, close sessions and the audit log (final signed checkpoint), in bounded time.

    The workers go first: killing them is instant, whereas asking each to close its sessions would wait
    behind any step still running (up to ``task_timeout_s``) and the shutdown must fit the drain window.
    The sessions are then closed (and audited) without a worker round trip.
    """
    sweeper = getattr(app.state, "private_sweeper", None)
    if sweeper is not None:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
    svc = getattr(app.state, "private", None)
    collector = getattr(app.state, "private_metrics", None)
    if collector is not None:  # lifespans restart in tests: register it afresh next time
        app.state.metrics.registry.unregister(collector)
        app.state.private_metrics = None
    if svc is not None:
        await svc.pool.close()
        await svc.close()  # close_session tasks now fail at once with WorkerError, which _close expects
        app.state.private = None
    audit = getattr(app.state, "audit", None)
    if audit is not None:
        audit.close()
        app.state.audit = None
