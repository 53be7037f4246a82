"""The state of one worker process: the plan's encrypted layers, loaded keys, per-session KV caches.

Runs only inside :mod:`server.private.workers` processes: every byte from a client is parsed here
(the SEAL backend's wire checks sizes, parameter hashes and key fingerprints before SEAL parses). The methods are
the worker's task names.

Failures are reported by where they happen, not by exception class: the client's bytes failing to parse
is :attr:`WorkerCode.BAD_CIPHERTEXT` (a 400); a session or position the worker does not hold has its own
code; any other exception — a ``ValueError`` from the computation included — is a server bug
(:attr:`WorkerCode.INTERNAL`, a 500). Key uploads are not failures at all: :meth:`inspect_key` returns
the inspector's verdict as data (:class:`server.keys.Inspection`).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable

import torch

from fhe.attention import EncryptedAttentionLayer, EncryptedKVCache
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import ServerKeys
from fhe.envelope import parse_key_upload
from fhe.errors import FHEError, RollbackError, ShapeError
from fhe.evaluator import check_fresh
from fhe.interleaved import require_chunks
from fhe.offload_fused import FUSED_PARTS
from fhe.params import CKKSParams, KeyLevels
from fhe.plan import Plan
from server.keys import Inspection, inspect_upload_keys
from server.private.codes import TaskFailure, WorkerCode


class StageClock:
    """The worker-side stage times of the task running now (``worker_parse``, ``worker_compute``,
    ``worker_serialize``: ``server.metrics.PRIVATE_STEP_STAGES``), taken by the pool's worker loop after each task
    (:meth:`PrivateCompute.take_stages`). Times only."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.t = time.monotonic()

    def start(self) -> None:
        self.t = time.monotonic()

    def lap(self, stage: str, sync: Callable[[], None] | None = None) -> None:
        """Add the time since the last lap to ``stage`` (``sync``: wait for the device first, so its queued work
        is counted where it was queued)."""
        if sync is not None:
            sync()
        now = time.monotonic()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self.t
        self.t = now

    def take(self) -> dict[str, float]:
        out, self.stages = self.stages, {}
        return out


class PrivateCompute:
    """Server half of the plan's encrypted attention blocks (no secret key ever reaches it)."""

    def __init__(self, model_dir: str, plan_path: str | None, max_tokens: int, device: str = "cpu",
                 step_processes: int = 1, offload_path: str | None = None, offload_chunks: bool = True,
                 offload_warm: bool = True, packed_kept_bytes: int = 0) -> None:
        from engine.loader import load_model

        torch.set_num_threads(1)  # one core per worker: parallelism comes from the pool
        model = load_model(model_dir)
        self.layers: dict[int, EncryptedAttentionLayer] = {}
        self.params = self.gpu = self.key_levels = None   # plan_path None: linear steps only, no attention
        if plan_path is not None:
            self._attention_blocks(model, Plan.load(plan_path), max_tokens, device, step_processes)
            keep_packed_plaintexts(self.gpu, packed_kept_bytes)
        self.steps = list(self.key_levels.steps) if self.key_levels is not None else []
        self.max_key_bytes = 1 << 30
        self.keys: dict[str, ServerKeys] = {}
        self.device_keys: dict[str, object] = {}   # fingerprint -> GpuKeys, with the gpu backend
        # the last PUBLIC upload this worker screened: (SHA-256 of its canonical bytes, the parsed keys), kept
        # for load_screened_key until the next load or inspection (at most one key set beyond the loaded ones)
        self._screened: tuple[str, ServerKeys] | None = None
        self.sessions: dict[str, tuple[str, dict[int, EncryptedKVCache]]] = {}
        self.clock = StageClock()
        self.linear = _OffloadLinear(model, offload_path, device, offload_chunks) if offload_path else None
        if self.linear is not None and offload_warm:   # worker start (key setup), not a session's first tokens
            self.linear.warm()

    def take_stages(self) -> dict[str, float]:
        """The stage times of the last task (for the pool's worker loop: ``server.private.workers.take_stages``)."""
        return self.clock.take()

    def _attention_blocks(self, model, plan: Plan, max_tokens: int, device: str, step_processes: int) -> None:
        plan.check_model(model)
        self.params = CKKSParams.from_dict(plan.ckks)
        self.gpu = _gpu_evaluator(self.params, device)
        self.layers = {i: EncryptedAttentionLayer(model.model.layers[i], model.rotary, plan.layer(i), model.config,
                                                  self.params, max_tokens, evaluator=self.gpu)
                       for i in plan.layer_indices}
        for layer in self.layers.values():   # fork-per-step split (fhe.fork): SEAL on the CPU only
            layer.processes = step_processes if self.gpu is None else 1
        # level-aware keys (docs/protocol.md): uploads must carry each key at the level the blocks use it
        self.key_levels = functools.reduce(KeyLevels.merge, (layer.key_levels for layer in self.layers.values()))

    # -- keys --------------------------------------------------------------------------------------
    def inspect_key(self, data: bytes) -> Inspection:
        """The production inspector's verdict on an upload, for this plan's parameters and rotations.

        With an offload plan, an upload whose public key names the MLP's parameters is screened at those
        (N differs, so no upload fits both): the verdict's ``params_hash`` says which key set it is."""
        self._screened = None   # before parsing: never two screened key sets in memory
        if self.linear is not None and (self.params is None or self.linear.owns_upload(data, self.max_key_bytes)):
            params, steps = self.linear.params, self.linear.steps
        else:
            params, steps = self.params, self.key_levels
        inspection, keys = inspect_upload_keys(data, params, steps, max_bytes=self.max_key_bytes)
        if keys is not None:
            self._screened = (hashlib.sha256(inspection.canonical).hexdigest(), keys)
        return inspection

    def load_key(self, fingerprint: str, data: bytes, key_set: str | None = None) -> None:
        """Parse a registered key set (screened when it was registered: a failure here is the server's)
        and keep it under its registry fingerprint. ``data`` is the registry's canonical re-serialization,
        so the key-set fingerprint the client's ciphertexts name is ``key_set`` (None: from ``data``)."""
        self._screened = None
        blobs = parse_key_upload(data, len(data))  # the server's own bytes: unseeded, larger than the upload
        if self.linear is not None and (self.params is None or self.linear.owns(blobs)):
            self._keep(fingerprint, wire.load_server_keys(blobs, self.linear.params, self.linear.steps,
                                                          fingerprint=key_set))
            return
        self._keep(fingerprint, wire.load_server_keys(blobs, self.params, self.key_levels, fingerprint=key_set))

    def load_screened_key(self, fingerprint: str, canonical_sha256: str, key_set: str) -> bool:
        """Keep the key set this worker screened last under ``fingerprint``, without its bytes, if it is the
        registered one: the SHA-256 of the canonical bytes written from it is the registry's
        ``canonical_sha256`` and it names ``key_set``. False (nothing kept): send the stored bytes to
        :meth:`load_key`. Registration then costs one SEAL parse, and the stored bytes are not read back,
        decrypted and sent to the worker again (``bench/key_registration.py``)."""
        screened, self._screened = self._screened, None
        if screened is None or screened[0] != canonical_sha256 or screened[1].fingerprint != key_set:
            return False
        keys = screened[1]
        if keys.params not in (self.params, self.linear.params if self.linear is not None else None):
            return False
        self._keep(fingerprint, keys)
        return True

    def _keep(self, fingerprint: str, keys: ServerKeys) -> None:
        """Hold a parsed key set: an offload (MLP parameters) one in the linear steps, else for attention."""
        if self.linear is not None and keys.params == self.linear.params:
            self.linear.load_key(fingerprint, keys)
            return
        self.keys[fingerprint] = keys
        if self.gpu is not None:   # expanded once onto the device (the service caps how many a worker holds)
            self.device_keys[fingerprint] = self.gpu.keys_from_server(self.keys[fingerprint])

    def drop_key(self, fingerprint: str) -> int:
        """Forget a key and every session that used it; returns the sessions dropped."""
        self.keys.pop(fingerprint, None)
        self.device_keys.pop(fingerprint, None)
        if self.linear is not None:
            self.linear.drop_key(fingerprint)
        doomed = [sid for sid, (fp, _) in self.sessions.items() if fp == fingerprint]
        for sid in doomed:
            del self.sessions[sid]
        return len(doomed)

    # -- sessions ------------------------------------------------------------------------------------
    def open_session(self, sid: str, fingerprint: str) -> None:
        if fingerprint not in self.keys:
            raise TaskFailure(WorkerCode.KEY_NOT_LOADED, "key not loaded in this worker")
        self.sessions[sid] = (fingerprint, {i: layer.new_cache() for i, layer in self.layers.items()})

    def close_session(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def step(self, sid: str, fingerprint: str, layer: int, start: int, blobs: list[bytes]) -> tuple[list[bytes], int]:
        """Run ``layer`` over positions start.. for the session; returns (result blobs, session bytes)."""
        return self._step(sid, fingerprint, layer, start, blobs,
                          lambda block, cache, cts, keys: block.prefill(cache, cts, start, keys))

    def step_verify(self, sid: str, fingerprint: str, layer: int, start: int,
                    blobs: list[bytes]) -> tuple[list[bytes], int]:
        """A speculative verify step (:func:`fhe.speculative.verify_step`): one decode per position, the
        cache rollback-able to any length inside the step until the next step or rollback."""
        from fhe.speculative import verify_step

        return self._step(sid, fingerprint, layer, start, blobs,
                          lambda block, cache, cts, keys: verify_step(block, cache, cts, start, keys),
                          speculative=True)

    def rollback(self, sid: str, fingerprint: str, layer: int, keep: int) -> tuple[int, int]:
        """Drop ``layer``'s positions from ``keep`` on; returns (positions dropped, session bytes).

        The service checked the request against the last verify step; a cache that cannot go back there
        (the worker restarted, or its state differs from the service's) is out of step: SESSION_DESYNC."""
        caches = self._caches(sid, fingerprint)
        try:
            dropped = caches[layer].rollback(keep)
        except RollbackError as exc:
            raise TaskFailure(WorkerCode.SESSION_DESYNC, f"layer {layer}: {exc}"[:300]) from exc
        return dropped, sum(c.nbytes() for c in caches.values())

    def _caches(self, sid: str, fingerprint: str) -> dict[int, EncryptedKVCache]:
        if sid not in self.sessions:
            raise TaskFailure(WorkerCode.SESSION_UNKNOWN, "unknown session in this worker")
        fp, caches = self.sessions[sid]
        if fp != fingerprint:  # the service pins a session to its key: a mismatch here is a server bug
            raise RuntimeError("session belongs to another key")
        return caches

    def step_packed(self, sid: str, fingerprint: str, layer: int, start: int, count: int,
                    blobs: list[bytes]) -> tuple[list[bytes], int]:
        """A packed prefill step: ``count`` tokens in ceil(count / chunk) ciphertexts; one result per token."""
        def run(block, cache, cts, keys):
            try:
                return block.prefill_packed(cache, cts, start, count, keys)
            except ShapeError as exc:   # the service checked the shape: this is a chunk the block refuses
                raise TaskFailure(WorkerCode.BAD_CIPHERTEXT, f"packed step: {exc}"[:300]) from exc

        return self._step(sid, fingerprint, layer, start, blobs, run)

    def _step(self, sid: str, fingerprint: str, layer: int, start: int, blobs: list[bytes],
              run, speculative: bool = False) -> tuple[list[bytes], int]:
        if sid not in self.sessions:
            raise TaskFailure(WorkerCode.SESSION_UNKNOWN, "unknown session in this worker")
        fp, caches = self.sessions[sid]
        if fp != fingerprint:  # the service pins a session to its key: a mismatch here is a server bug
            raise RuntimeError("session belongs to another key")
        keys, block = self.keys[fp], self.layers[layer]
        cache = caches[layer]
        if cache.length != start:
            raise TaskFailure(WorkerCode.SESSION_DESYNC,
                              f"layer {layer} holds {cache.length} positions, step starts at {start}")
        clock = self.clock
        clock.start()
        cts = (self._inputs(blobs, keys, block.ev.top) if self.gpu is None
               else device_inputs(self.gpu, blobs, keys, block.ev.top))
        clock.lap("worker_parse", self._sync)
        if not speculative:   # a plain step after a verify step makes its positions final
            cache.commit()
        outs = run(block, cache, cts, keys if self.gpu is None else self.device_keys[fp])
        clock.lap("worker_compute", self._sync)
        out = ([wire.dump_ciphertext(c, self.params, keys.fingerprint) for c in outs] if self.gpu is None
               else device_results(self.gpu, outs, keys.fingerprint))
        clock.lap("worker_serialize")
        return out, sum(c.nbytes() for c in caches.values())

    def _sync(self) -> None:
        _sync_device(self.gpu)

    def mlp_step(self, fingerprint: str, layer: int, part: str, blobs: list[bytes], packed: bool = False
                 ) -> list[bytes]:
        """One linear step of an offload plan (an MLP half, or ``attn_qkv`` / ``attn_o`` of an attention run
        as linear steps) over one position, or, ``packed`` (a step of >= 2 positions), in the chunk layout
        (:mod:`fhe.interleaved`: T ciphertexts per chunk in, G per chunk out); stateless: no session state,
        so any worker holding the offload key set runs it. One position: ``mlp_up`` answers
        ``outputs_per_position`` ciphertexts, every other part one."""
        if self.linear is None or fingerprint not in self.linear.keys:
            raise TaskFailure(WorkerCode.KEY_NOT_LOADED, "offload key set not loaded in this worker")
        keys, clock = self.linear.keys[fingerprint], self.clock
        clock.start()
        block, _ = self.linear.part(layer, part)
        cts = self.linear.inputs(blobs, keys, block.ev.top)
        clock.lap("worker_parse", self.linear.sync)
        if packed:   # several positions: the chunk layout, T ciphertexts per chunk in, G out
            return self.linear.chunk_blobs(fingerprint, layer, part, cts, clock)
        if self.linear.gpu is not None:
            return self.linear.run_batch([(fingerprint, cts)], layer, part, clock)[0]
        outs = self.linear.run(fingerprint, layer, part, cts)
        clock.lap("worker_compute")
        blobs = [wire.dump_ciphertext(c, self.linear.params, keys.fingerprint) for c in outs]
        clock.lap("worker_serialize")
        return blobs

    def mlp_step_batch(self, items: list[tuple]) -> list:
        """Several sessions' :meth:`mlp_step` calls of one (layer, part) and layout, each ``(fingerprint, layer,
        part, blobs[, packed])``: on the gpu backend every position of every item in one batched evaluation,
        each row under its own session's key set (:meth:`_OffloadLinear.run_batch`); on SEAL one by one.
        Returns one entry per item, its result or the exception it failed with (an item whose bytes fail
        fails alone)."""
        items = [(*item, False) if len(item) == 4 else tuple(item) for item in items]
        if (self.linear is None or self.linear.gpu is None or len({item[1:3] + item[4:] for item in items}) != 1
                or items[0][4]):   # chunk-layout steps run one by one (no batched graph of them yet)
            return [_result_or_error(self.mlp_step, *item) for item in items]
        _, layer, part, _, _ = items[0]
        block, _ = self.linear.part(layer, part)
        out: list = [None] * len(items)
        ready = []   # (item index, fingerprint, parsed ciphertexts)
        self.clock.start()
        for n, (fp, _, _, blobs, _) in enumerate(items):
            try:
                if fp not in self.linear.keys:
                    raise TaskFailure(WorkerCode.KEY_NOT_LOADED, "offload key set not loaded in this worker")
                ready.append((n, fp, self.linear.inputs(blobs, self.linear.keys[fp], block.ev.top)))
            except TaskFailure as exc:
                out[n] = exc
        self.clock.lap("worker_parse", self.linear.sync)
        results = (self.linear.run_batch([(fp, cts) for _, fp, cts in ready], layer, part, self.clock)
                   if ready else [])
        for (n, _, _), blobs in zip(ready, results, strict=True):
            out[n] = blobs
        return out

    @staticmethod
    def _inputs(blobs: list[bytes], keys: ServerKeys, top: int, first: int = 0) -> list:
        """The client's ciphertexts, parsed and checked fresh (level, size, scale): any refusal here is
        the client's fault, and only here (``first``: the index of ``blobs[0]`` in the step, for the message)."""
        cts = []
        for i, blob in enumerate(blobs, first):
            try:
                ct = wire.load_ciphertext(blob, keys.kit, keys.fingerprint, level=top)
                keys.check_input(ct)
            except FHEError as exc:
                raise TaskFailure(WorkerCode.BAD_CIPHERTEXT, f"ciphertext {i}: {exc}"[:300]) from exc
            cts.append(ct)
        return cts


#: chunks of a chunk-layout step per graph replay on the gpu backend (:meth:`_OffloadLinear._chunks_on_device`):
#: 32 positions, a typical prompt chunk; fewer are padded (rows are cheap: a step's batch of 8 cost 1.3x one
#: on the H200, docs/benchmarks.md, gpu17 session 8), more take several replays
CHUNK_ROWS = 4


class _OffloadLinear:
    """The linear blocks of an offload plan (``[private] offload_plan``) and their key sets: the server MLPs
    and the attention blocks it runs as linear steps (``softmax = client``), under one key set.

    They run at :data:`fhe.mlp.MLP_PARAMS` on the backend ``[private] device`` names: SEAL on 'cpu', else
    the gpu backend. The plan's diagonals are encoded once per layer here and stay on the device: on CUDA by
    the on-device encoder in batches (``encoder="fft"``; the 28-layer plan's ~235k diagonals took ~8 min of
    worker start through SEAL's encoder on one core, issue 17; a coefficient may differ from SEAL's by one,
    so results decrypt to SEAL's within CKKS noise, not bit for bit), on the torch-CPU reference
    ('cpu-reference', what CI checks bit for bit against SEAL) by SEAL's encoder. Each key set is expanded
    onto the device once, when it is loaded.
    """

    def __init__(self, model, offload_path: str, device: str = "cpu", chunks: bool = True,
                 encoder: str | None = None) -> None:
        from fhe.mlp import MLP_PARAMS, EncryptedMLP
        from fhe.offload import OffloadPlan
        from fhe.offload_attention import EncryptedAttentionLinear

        plan = OffloadPlan.load(offload_path)
        self.params = MLP_PARAMS
        self.gpu = _gpu_evaluator(self.params, device, encoder=encoder or _plan_encoder(device))
        self.linear_steps = plan.linear_steps()   # (layer, part) in the order a token runs them
        layers = model.model.layers
        # a fused plan runs attn_qkv only on the first layer of a run and mlp_down only on its last: the
        # four-step blocks exist only where one of their steps runs
        mlp_at = {i for i, p in self.linear_steps if p in ("mlp_up", "mlp_down")}
        att_at = {i for i, p in self.linear_steps if p in ("attn_qkv", "attn_o")}
        self.blocks = {i: EncryptedMLP(layers[i], self.params, evaluator=self.gpu, chunks=chunks)
                       for i in sorted(mlp_at)}
        self.attention = {i: EncryptedAttentionLinear(layers[i], model.config, self.params, evaluator=self.gpu,
                                                      chunks=chunks) for i in sorted(att_at)}
        self.fused = _fused_blocks(layers, self.linear_steps, self.params, self.gpu, chunks)
        steps: set[int] = set()
        for block in (*self.blocks.values(), *self.attention.values(), *self.fused.values()):
            steps |= block.rotation_steps
        self.steps = tuple(sorted(steps))
        self.keys: dict[str, ServerKeys] = {}
        self.device_keys: dict[str, object] = {}   # fingerprint -> GpuKeys, with the gpu backend
        self.graphs = None                          # whole steps as CUDA graphs, per (layer, part, batch size)
        self.warm_s = 0.0                           # seconds :meth:`warm` took
        if self.gpu is not None:
            from fhe.backends.gpu.step import StepGraphs

            self.graphs = StepGraphs(self.gpu)

    def inputs(self, blobs: list[bytes], keys: ServerKeys, top: int) -> list:
        """The client's ciphertexts of a linear step, parsed and checked fresh (any refusal is
        ``bad_ciphertext``, the client's fault). On SEAL: :meth:`PrivateCompute._inputs`, SEAL ciphertexts. On
        the gpu backend, device ciphertexts: :func:`device_inputs` (full and seeded uploads read straight into
        device tensors, a seeded one's c1 expanded on the device)."""
        if self.gpu is None:
            return PrivateCompute._inputs(blobs, keys, top)
        return device_inputs(self.gpu, blobs, keys, top)

    def sync(self) -> None:
        _sync_device(self.gpu)

    def device(self, ct):
        """A device ciphertext of ``ct`` (already one, or a SEAL ciphertext SEAL parsed and checked)."""
        from fhe.backends.gpu.evaluator import GpuCiphertext

        return ct if isinstance(ct, GpuCiphertext) else self.gpu.deserialize(seal.to_bytes(ct))

    def load_key(self, fingerprint: str, keys: ServerKeys) -> None:
        """Keep a parsed MLP key set (and, on the gpu backend, its device copy: expanded once, here)."""
        self.keys[fingerprint] = keys
        if self.gpu is not None:
            self.device_keys[fingerprint] = self.gpu.keys_from_server(keys)

    def drop_key(self, fingerprint: str) -> None:
        self.keys.pop(fingerprint, None)
        self.device_keys.pop(fingerprint, None)

    def run(self, fingerprint: str, layer: int, part: str, cts: list) -> list:
        """``part`` of ``layer`` on SEAL ciphertexts already checked by the wire (one position each); SEAL
        ciphertexts back."""
        keys = self.keys[fingerprint]
        _, step = self.part(layer, part)
        if self.gpu is None:
            return [c for ct in cts for c in step(ct, keys)]
        # uncompressed: SEAL loads it at once here (random residues compress 6–10 %; zstd cost both ways)
        return [seal.from_bytes("ciphertext", keys.kit, self.gpu.serialize(c, compress=False))
                for row in self._on_device(layer, part, cts, self.device_keys[fingerprint]) for c in row]

    def run_chunks(self, fingerprint: str, layer: int, part: str, cts: list) -> list:
        """A multi-position step of ``part`` in the chunk layout on SEAL ciphertexts already checked by the
        wire (T per chunk); SEAL ciphertexts back (G per chunk). On the gpu backend: :meth:`_chunks_on_device`."""
        block, _ = self.part(layer, part)
        keys = self.keys[fingerprint]
        if self.gpu is None:
            return block.chunk(part, cts, keys)
        xs = [self.device(ct) for ct in cts]
        return [seal.from_bytes("ciphertext", keys.kit, self.gpu.serialize(c, compress=False))
                for c in self._chunks_on_device(layer, part, xs, self.device_keys[fingerprint])]

    def chunk_blobs(self, fingerprint: str, layer: int, part: str, cts: list,
                    clock: StageClock | None = None) -> list[bytes]:
        """:meth:`run_chunks` as wire blobs; on the gpu backend the device serialization goes into the wire as is
        (as :meth:`run_batch` does: no SEAL load and zstd save per result, ~48 results per server layer of a
        32-position prefill)."""
        keys, clock = self.keys[fingerprint], clock or StageClock()
        if self.gpu is None:
            outs = self.run_chunks(fingerprint, layer, part, cts)
            clock.lap("worker_compute")
            blobs = [wire.dump_ciphertext(c, self.params, keys.fingerprint) for c in outs]
            clock.lap("worker_serialize")
            return blobs
        outs = self._chunks_on_device(layer, part, [self.device(ct) for ct in cts],
                                      self.device_keys[fingerprint])
        clock.lap("worker_compute", self.sync)
        blobs = [wire.pack_ciphertext(self.gpu.serialize(c, compress=False), self.params, keys.fingerprint)
                 for c in outs]
        clock.lap("worker_serialize")
        return blobs

    def _chunks_on_device(self, layer: int, part: str, xs: list, keys) -> list:
        """Device ciphertexts of a chunk-layout step (T per chunk, chunks in order) -> G per chunk, in order.

        Each chunk is one row of a batch (``[B, T, 2, L, N]``: its T tiles), the step one
        :class:`fhe.backends.gpu.step.StepGraphs` replay per :data:`CHUNK_ROWS` chunks (padded: one graph per
        (layer, part) serves every prompt length; the rows compute on the device in parallel). Each row's
        result is the chunk evaluated alone (the batched evaluator's residues are the one-session ones)."""
        block, _ = self.part(layer, part)
        chunks = require_chunks(block.chunks)
        tiles = chunks.shapes[part].tiles
        if not xs or len(xs) % tiles:
            raise ShapeError(f"{part}: chunks of {tiles} ciphertexts, got {len(xs)}")
        for x in xs:
            check_fresh(self.gpu, keys, x)
        from fhe.backends.gpu.evaluator import GpuCiphertext

        rows = [GpuCiphertext(torch.stack([x.data for x in xs[c:c + tiles]]), xs[c].scale)   # [T, 2, L, N]
                for c in range(0, len(xs), tiles)]
        fn, name = _chunk_step(chunks, part), (layer, part, "chunk")
        out = []
        for lo in range(0, len(rows), CHUNK_ROWS):
            group = rows[lo:lo + CHUNK_ROWS]
            group += [group[0]] * (CHUNK_ROWS - len(group))          # padding rows: computed, dropped
            res = self.graphs.run(name, fn, group, keys)[: len(rows[lo:lo + CHUNK_ROWS])]
            out += [c for row in res for c in row]
        return out

    def warm(self) -> float:
        """Capture every linear step's CUDA graphs now (the worker's start, i.e. the tenant's key setup)
        instead of on the first tokens that run them: each (layer, part) at one position (decode) and, with
        the chunk layout, at :data:`CHUNK_ROWS` chunks (prefill, verify). The graphs read their keys from
        static buffers, so zero keys of the offload key set's shape serve for the capture (a real key set is
        copied in before its first replay). Returns the seconds it took (0 off CUDA: nothing to capture)."""
        if self.graphs is None or not self.graphs.cuda:
            return 0.0
        from fhe.backends.gpu.evaluator import GpuCiphertext

        t0 = time.perf_counter()
        keys = placeholder_keys(self.gpu, self.steps)
        shape = (2, self.gpu.top, self.params.poly_modulus_degree)
        zero = GpuCiphertext(torch.zeros(shape, dtype=torch.int64, device=self.gpu.device), self.gpu.kit.scale)
        for layer, part in self.parts():
            self._device_step(layer, part, [zero], keys)
            block, _ = self.part(layer, part)
            if getattr(block, "chunks", None) is not None:
                self._chunks_on_device(layer, part, [zero] * block.chunks.shapes[part].tiles, keys)
        torch.cuda.synchronize(self.gpu.device)
        self.warm_s = time.perf_counter() - t0
        return self.warm_s

    def parts(self) -> list[tuple[int, str]]:
        """Every (layer, part) this plan runs as a linear step."""
        return list(self.linear_steps)

    def run_batch(self, items: list[tuple[str, list]], layer: int, part: str,
                  clock: StageClock | None = None) -> list[list]:
        """:meth:`run` for several sessions at once on the gpu backend, ``items`` = (fingerprint, checked SEAL
        ciphertexts) each: every position of every item is one row of one batch (one graph replay of the
        step, :class:`fhe.backends.gpu.step.StepGraphs`), each row under its session's device key set. Per
        item, its outputs as wire blobs in :meth:`run`'s order (position by position, each position's products
        in order): the device serialization goes into the wire as is (:func:`fhe.backends.seal.wire.pack_ciphertext`:
        no SEAL load and zstd pass per result, 0.5 ms of a step's host time; docs/benchmarks.md, serving17)."""
        cts = [ct for _, item in items for ct in item]
        keys = [self.device_keys[fp] for fp, item in items for _ in item]
        clock = clock or StageClock()
        rows = iter(self._on_device(layer, part, cts, keys))
        clock.lap("worker_compute", self.sync)
        out = [[wire.pack_ciphertext(self.gpu.serialize(c, compress=False), self.params, self.keys[fp].fingerprint)
                for _ in item for c in next(rows)] for fp, item in items]
        clock.lap("worker_serialize")
        return out

    def _on_device(self, layer: int, part: str, cts: list, keys) -> list[list]:
        """The step on the device for checked ciphertexts ``cts`` (device ones from :meth:`inputs`, or SEAL ones:
        the device copies are ours) under ``keys`` (one device key set, or one per ciphertext): per input,
        its outputs. Ciphertexts of one shape and scale run as one batch, one graph replay."""
        return self._device_step(layer, part, [self.device(ct) for ct in cts], keys)

    def _device_step(self, layer: int, part: str, xs: list, keys) -> list[list]:
        """:meth:`_on_device` on device ciphertexts."""
        block, step = self.part(layer, part)
        fn, name = _batched(block, step), (layer, part)   # the name must always mean the same plaintexts
        if len({(x.data.shape, x.scale) for x in xs}) == 1:
            return self.graphs.run(name, fn, xs, keys)
        per_row = keys if isinstance(keys, list) else [keys] * len(xs)
        return [r for x, k in zip(xs, per_row, strict=True) for r in self.graphs.run(name, fn, [x], k)]

    def device_nbytes(self) -> dict[str, int]:
        """Device bytes of the encoded weights (every linear block: MLPs, attention as linear steps; per
        server layer) and of one loaded key set (0 on SEAL)."""
        if self.gpu is None:
            return {"weights": 0, "per_layer": 0, "key_set": 0}
        weights = sum(_plaintext_nbytes(b) for b in (*self.blocks.values(), *self.attention.values(),
                                                     *self.fused.values()))
        key_set = next(iter(self.device_keys.values())).nbytes() if self.device_keys else 0
        layers = len(set(self.blocks) | set(self.attention) | set(self.fused))
        return {"weights": weights, "per_layer": weights // max(layers, 1), "key_set": key_set}

    def part(self, layer: int, part: str):
        """(block, run) of one checked one-position step: ``run(ct, keys)`` -> the part's result ciphertexts."""
        if part in FUSED_PARTS:
            block = self.fused[layer]
            return block, functools.partial(block.step, part)
        if part in ("attn_qkv", "attn_o"):
            block = self.attention[layer]
            fn = block.qkv if part == "attn_qkv" else block.o
            return block, lambda ct, k: [fn(ct, k)]
        block = self.blocks[layer]
        return block, block.gate_up if part == "mlp_up" else (lambda ct, k: [block.down(ct, k)])

    def owns_upload(self, data: bytes, max_bytes: int) -> bool:
        """Whether an untrusted upload claims the MLP's parameters (its framing and the public key's wire
        envelope only: the allow-list then screens it at those parameters)."""
        from fhe.envelope import EnvelopeError

        try:
            return self.owns(parse_key_upload(data, max_bytes))
        except EnvelopeError:
            return False

    def owns(self, blobs: dict[str, bytes]) -> bool:
        """Whether a stored key set (already screened) is an MLP key set: its public key names our ring."""
        try:
            wire.unpack_public_keys({"public_key": blobs["public_key"]}, self.params)
        except (FHEError, KeyError, ValueError):
            return False
        return True


def _fused_blocks(layers, linear_steps, params, gpu, chunks: bool) -> dict:
    """Per layer with fused steps (:mod:`fhe.offload_fused`), its :class:`~fhe.offload_fused.EncryptedFused`
    holding that layer's ``o_up`` and/or ``down_qkv`` (the latter with the next layer's q/k/v)."""
    from fhe.offload_fused import EncryptedFused, fused_weights

    parts: dict[int, list[str]] = {}
    for i, p in linear_steps:
        if p in FUSED_PARTS:
            parts.setdefault(i, []).append(p)
    return {i: EncryptedFused({p: fused_weights(layers[i], p, layers[i + 1] if p == "down_qkv" else None)
                               for p in ps}, params, evaluator=gpu, chunks=chunks)
            for i, ps in sorted(parts.items())}


def _batched(block, step):
    """``step`` (a block's method for one ciphertext, on ``block.ev``) as a step of a batch: the same operations
    through the batched evaluator :class:`fhe.backends.gpu.step.StepGraphs` hands it (sharing block.ev's
    plaintexts), for the call only (a worker runs one step at a time)."""
    def fn(ev, x, keys):
        own, block.ev = block.ev, ev
        try:
            return step(x, keys)
        finally:
            block.ev = own

    return fn


def _chunk_step(chunks, part: str):
    """A chunk-layout step of ``part`` (:class:`fhe.interleaved.ChunkProducts`) as a batched step: row b of the
    input ``[B, T, 2, L, N]`` is one chunk's T tiles; returns the G output batches (row b: chunk b's), as
    ``ChunkProducts.chunk_outputs`` makes them for one chunk."""
    from fhe.backends.gpu.batched import GpuBatch

    def fn(ev, x, keys):
        return chunks.chunk_outputs(ev, part, [GpuBatch(x.data[:, t], x.scale) for t in range(x.data.shape[1])], keys)

    return fn


def placeholder_keys(gpu, steps) -> object:
    """Zero device keys shaped as a full offload key set for ``steps`` (relin + one Galois key per step, every
    key on the whole chain): what :meth:`_OffloadLinear.warm` captures graphs with. No key material: zeros."""
    from fhe.backends.gpu.galois import galois_elt
    from fhe.backends.gpu.keys import GpuKeys

    k, n = gpu.ctx.K, gpu.params.poly_modulus_degree

    def zeros():
        return torch.zeros((k, 2, k + 1, n), dtype=torch.int64, device=gpu.device)

    return GpuKeys(gpu.params, zeros(), {galois_elt(s, gpu.params.slots): zeros() for s in steps}, tuple(steps),
                   "placeholder")


def _sync_device(gpu) -> None:
    """Wait for the gpu backend's queued device work (CUDA only; None: SEAL, nothing queued), so that a stage's
    time is its own, not the next one's."""
    if gpu is not None and gpu.device.type == "cuda":
        torch.cuda.synchronize(gpu.device)


def device_inputs(gpu, blobs: list[bytes], keys: ServerKeys, top: int) -> list:
    """A step's client ciphertexts as device ciphertexts of the gpu backend ``gpu``, parsed and checked fresh;
    any refusal is ``bad_ciphertext`` (the client's fault), and only here.

    Full (unseeded) and seeded uploads are read straight into device tensors
    (:meth:`~fhe.backends.gpu.evaluator.GpuEvaluator.deserialize_fresh_many`: the same residues and the same
    refusals as SEAL's load with the freshness check; a step's uploads on a thread pool; a seeded upload's c1
    expanded on the device from its seed, as SEAL's load expands it: :mod:`fhe.backends.gpu.uniform`). Anything
    that parse does not take (a seed of SEAL's other PRNG, a malformed upload) goes through SEAL, which refuses
    with a typed error what it refuses; its device copy is then ours. At the attention plan's N = 32768 the
    direct parse spares SEAL's load, a zstd save and our parse of that per upload (``bench/worker_handoff.py``)."""
    payloads = []
    for i, blob in enumerate(blobs):
        try:
            payloads.append(wire.ciphertext_payload(blob, gpu.params, keys.fingerprint))
        except FHEError as exc:
            raise TaskFailure(WorkerCode.BAD_CIPHERTEXT, f"ciphertext {i}: {exc}"[:300]) from exc
    out = gpu.deserialize_fresh_many(payloads)
    for i, x in enumerate(out):
        if x is None:   # anything else: SEAL parses and checks it, then the device copy is ours
            (ct,) = PrivateCompute._inputs([blobs[i]], keys, top, first=i)
            try:
                out[i] = gpu.deserialize(seal.to_bytes(ct))
            except FHEError as exc:
                raise TaskFailure(WorkerCode.BAD_CIPHERTEXT, f"ciphertext {i}: {exc}"[:300]) from exc
    return out


def device_results(gpu, outs: list, fingerprint: str) -> list[bytes]:
    """Device ciphertexts of a step's results as wire blobs: the gpu backend's own serialization (SEAL's format,
    zstd-compressed as SEAL saves it, which the SDK's SEAL loads) goes into the envelope as is, without a SEAL
    load and save per result."""
    return [wire.pack_ciphertext(gpu.serialize(c), gpu.params, fingerprint) for c in outs]


def _result_or_error(fn, *args):
    """``fn(*args)``, or the exception it raised (a batch item's outcome: :func:`server.private.workers.run_batch`)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - classified per item by the worker loop, as run_task does
        return exc


def _plaintext_nbytes(block) -> int:
    """Device bytes of an encoded linear block's diagonals: every EncodedMatvec's plaintexts, and the chunk
    layout's (``block.chunks``, when the block has it: ~2/3 of the total for SmolLM2)."""
    encoded = [v for name, v in vars(block).items() if name.startswith("_enc_")]
    encoded = [e for v in encoded for e in (v if isinstance(v, list) else [v])]
    total = sum(pt.data.numel() * 8 for e in encoded for grp in e.encoded.plaintexts.values() for _, pt in grp)
    chunks = getattr(block, "chunks", None)
    if chunks is not None:
        total += sum(pt.data.numel() * 8 for e in chunks.encoded.values()
                     for grp in e.plaintexts.values() for _, _, pt in grp)
    return total


def _plan_encoder(device: str) -> str:
    """The encoder of a plan's diagonals on ``device`` (see :class:`_OffloadLinear`)."""
    return "fft" if device.startswith("cuda") else "seal"


def keep_packed_plaintexts(gpu, nbytes: int) -> None:
    """``[private] packed_plain_cache_gb`` (in bytes) as this worker process's ``fhe.packed.PLAIN_CACHE_BYTES``
    (each attention layer's budget), on the gpu backend only (``gpu`` None: SEAL, whose maps are never kept)."""
    if gpu is not None and nbytes:
        from fhe import packed

        packed.PLAIN_CACHE_BYTES = int(nbytes)


def _gpu_evaluator(params: CKKSParams, device: str, encoder: str = "fft"):
    """The gpu backend for ``[private] device`` (None for 'cpu': the blocks default to SEAL).

    The on-device encoder (``encoder="fft"``, the attention blocks') encodes the per-step RoPE weights; its
    results decrypt to SEAL's within CKKS noise (docs/fhe.md §9), and without it a decode step spends most
    of its time in SEAL's CPU encoder. Blocks whose plaintexts are all made once (the MLP) take ``"seal"``.
    """
    if device == "cpu":
        return None
    from fhe.backends.gpu import GpuEvaluator

    return GpuEvaluator(params, "cpu" if device == "cpu-reference" else device, encoder=encoder)


def make_state(model_dir: str, plan_path: str | None, max_tokens: int, device: str = "cpu",
               step_processes: int = 1, offload_path: str | None = None, offload_chunks: bool = True,
               offload_warm: bool = True, packed_kept_bytes: int = 0) -> PrivateCompute:
    """Worker factory (``server.private.workers`` imports it by name); ``plan_path`` None: an offload plan of
    linear steps only (``offload_path``), no attention block; ``offload_chunks``: ``[private]
    offload_chunk_layout``; ``offload_warm``: ``[private] offload_warm_graphs``; ``packed_kept_bytes``: ``[private]
    packed_plain_cache_gb`` in bytes."""
    return PrivateCompute(model_dir, plan_path, max_tokens, device, step_processes, offload_path, offload_chunks,
                          offload_warm, packed_kept_bytes)


__all__ = ["PrivateCompute", "make_state"]
