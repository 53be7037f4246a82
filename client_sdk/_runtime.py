"""The client half of the server's plan, built from the engine's own pieces.

Text, token ids and plaintext activations never leave this process. The runtime

* runs the bundle's model through the engine's forward (:meth:`engine.model.LlamaForCausalLM.forward`)
  with an :class:`~engine.model.AttentionBackend` of its own: plaintext layers attend over a local
  :class:`~engine.model.DenseKVCache`, and each encrypted layer's attention — whose projections stay on
  the server — is an :class:`EncryptedAttention` that hands the normalized input to the backend, which
  encrypts it, sends one step and decrypts ``sum_h y_h / z_h``;
* samples with the engine's :class:`~engine.sampler.Sampler` and turns tokens into text, stop decisions
  and stream deltas with the engine's :class:`~engine.output_processor.OutputProcessor` (the same
  stop-string hold-back, stop ids, EOS and length rules as the server);
* does no I/O itself: every HTTP exchange is a :class:`~client_sdk._protocol.Call` performed by the
  ``exchange`` function of a driver (the blocking or the asyncio client).

Robustness: a step that fails with a transient error is retried by the driver (the server answers a
repeated step from its record); a lost session (worker restart, TTL) is replaced by a new one on the
same registered key and the positions so far are replayed — keys are never uploaded again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from client_sdk import _protocol as proto
from client_sdk._crypto_pool import default_processes
from client_sdk._exceptions import PrivateModeError
from client_sdk._threads import ThreadScope, threads_of
from client_sdk._threads import refresh as refresh_threads

_REQUEST_IDS = itertools.count()


@dataclasses.dataclass
class StepStats:
    """Wire and time accounting of one generated token (all encrypted layers)."""

    seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    steps: int = 0
    #: an offload plan's MLP steps by part: part -> [seconds, bytes up, bytes down, steps] (the attention
    #: steps are the totals minus these)
    parts: dict[str, list] = dataclasses.field(default_factory=dict)

    def record(self, part: str, seconds: float, up: int, down: int) -> None:
        """Count one step of ``part`` in the totals and in its part's row."""
        self.seconds, self.bytes_up, self.bytes_down, self.steps = (self.seconds + seconds, self.bytes_up + up,
                                                                    self.bytes_down + down, self.steps + 1)
        row = self.parts.setdefault(part, [0.0, 0, 0, 0])
        row[0], row[1], row[2], row[3] = row[0] + seconds, row[1] + up, row[2] + down, row[3] + 1


@dataclasses.dataclass
class PrivateToken:
    """One sampled token of a private generation and the text it makes safe to show.

    ``text`` is the engine's stream delta: text that could still begin a stop string is held back
    and shown with a later token (or never, if the stop string completes).
    """

    token_id: int
    text: str
    finish_reason: str | None
    stats: StepStats
    logprobs: dict[int, float] | None = None


class EncryptedAttention(nn.Module):
    """The attention of an encrypted layer in the client's copy of the model.

    Its projections never leave the server, so it passes the layer's normalized input (the bundle's
    ``input_layernorm`` of such a layer has a unit gain: the real gain is folded into the server's
    projections) to the backend's :meth:`EncryptedBackend.attend_encrypted`.
    """

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Any, backend: Any) -> torch.Tensor:
        return backend.attend_encrypted(self.layer_idx, x, positions)


def client_model(model: nn.Module, encrypted_layers: tuple[int, ...]) -> nn.Module:
    """The bundle's model with each encrypted layer's attention (withheld weights) replaced by the seam."""
    from engine.model import RMSNorm

    cfg = model.config
    for i in encrypted_layers:
        layer = model.layers[i]
        layer.self_attn = EncryptedAttention(i)
        layer.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # unit gain: normalize only
    return model.eval()


class EncryptedBackend:
    """AttentionBackend of one private generation: a local dense cache + the server's encrypted layers."""

    def __init__(self, runtime: PrivateRuntime, cache: Any, stats: StepStats) -> None:
        self.runtime, self.cache, self.stats = runtime, cache, stats

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Plaintext layers: the engine's dense per-sequence cache."""
        return self.cache.attend(layer, q, k, v)

    def attend_encrypted(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x̂ [T, hidden] at ``positions`` -> the layer's attention output [T, hidden], via one server step."""
        out = self.runtime.encrypted_attention(layer, int(positions[0]), x, self.stats).to(x.dtype)
        refresh_threads(self.runtime)   # a decode step's count picked again after the server's seconds
        return out


class PrivateRuntime:
    """Bundle model, tokenizer, CKKS keys and one session at a time.

    Args:
        client: a driver — :class:`client_sdk.Client`, or the async client's thread adapter — giving
            ``_exchange(call) -> Reply``, ``timeout``, ``progress`` and ``key_store``.
        key_id: name of the registered key.
        cache_dir: where verified bundles are kept (default ``$CIPHERLM_HOME/client``).
        key_store: an open :class:`client_sdk.KeyStore` (default: the client's): the CKKS key set is kept
            there (secret encrypted at rest), reused across processes and uploaded only if the server
            does not hold it yet. None: a fresh key set per runtime.
    """

    def __init__(self, client: Any, key_id: str = "sdk", cache_dir: str | Path | None = None,
                 key_store: Any = None) -> None:
        self.exchange: proto.Exchange = client._exchange
        self.read_floor = float(client.timeout.read)
        self.progress: proto.ProgressCallback | None = getattr(client, "progress", None)
        self.key_id = key_id
        self.key_store = key_store if key_store is not None else getattr(client, "key_store", None)
        if cache_dir is None:
            from engine.default_model import cipherlm_home

            cache_dir = cipherlm_home() / "client"
        self.cache_dir = Path(cache_dir)
        self.manifest: proto.Manifest | None = None
        self.session: proto.Session | None = None
        self.upload_bytes = 0
        self.key_bytes = 0
        self._tenant_limits: dict[str, Any] | None = None
        #: Send prefills as packed chunks where the server takes them (False: one ciphertext per token,
        #: the path before issue 15 — benchmarks compare both in one run).
        self.packed_prefill = True
        #: an offload plan's MLP half (manifest ``offload``; None: the partial plan) and the stats of the
        #: token being computed (its MLP steps count there)
        self.offload_info: Any = None
        self.offload: Any = None
        self.current_stats = StepStats()
        #: Processes that encrypt and decrypt the ciphertexts of one offload step of several (a prefill chunk:
        #: ~36 in, up to ~48 out), forked after the key set exists so that each inherits the secret key in
        #: memory (never written or sent; ``client_sdk._crypto_pool``). 1: one at a time in this process (the
        #: path before). Default: ``$CIPHERLM_CRYPTO_PROCESSES``, else this machine's cores, at most 8.
        self.crypto_processes = default_processes()
        #: Draft tokens per speculative step for requests that do not say (``num_speculative_tokens``;
        #: 0: only requests that ask speculate). Needs a server that takes verify steps (manifest).
        self.num_speculative_tokens = 0
        #: True while a speculative verify forward runs (its encrypted steps are sent as ``verify``).
        self.verifying = False
        #: The last generation's :class:`client_sdk._speculate.Speculation` (its acceptance counters), or
        #: None when it did not speculate.
        self.last_speculation: Any = None
        #: For full uploads (manifest ``upload``), make each attention step's encryption of zero on a thread while
        #: the previous step is on the server (``client_sdk._zeros``; False: encrypt in the step, as before).
        self.zeros_ahead = True
        self._zeros_ahead: Any = None
        #: torch's intra-op threads for this runtime's decode steps (clear layers, head), set around that work
        #: only (``client_sdk._threads``). None: ``$CIPHERLM_THREADS``, ``$OMP_NUM_THREADS``, else at each step
        #: the physical cores minus the tasks running elsewhere then.
        self.threads: int | None = None
        self.thread_scope = ThreadScope()

    # -- setup -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Manifest, bundle (downloaded once, verified by SHA-256), keys generated or loaded, registered."""
        if self.manifest is not None:
            return
        man = self.fetch_manifest()
        self.load_bundle(man)
        self.register_keys(man)
        self.manifest = man

    def register_keys(self, man: proto.Manifest) -> int:
        """Every key set the manifest's sessions run on, made (or loaded) and registered; returns the bytes
        uploaded. The attention key set only where some layer needs it: an offload plan whose server layers
        are all linear steps runs on its offload key set (N = 8192) alone."""
        if man.attention_key:
            self.make_keys(man)
        else:
            self.ckks, self.blocks, self.fingerprint, self.key_bytes, self.upload_bytes = None, {}, None, 0, 0
        if self.offload is None:
            return self.upload_bytes
        self.offload.make_keys(man)
        return self.upload_bytes + self.offload.upload_bytes

    def fetch_manifest(self) -> proto.Manifest:
        """``GET /v1/private/manifest`` (``PrivacyModeError`` when the server offers no encrypted sessions)."""
        from client_sdk._exceptions import NotFoundError, PrivacyModeError
        from client_sdk._offload import OffloadInfo

        try:
            raw = self.exchange(proto.MANIFEST).json()
            self.offload_info = OffloadInfo.from_manifest(raw)
            return proto.Manifest.from_json(raw)
        except NotFoundError as exc:
            raise PrivacyModeError("this server offers no encrypted sessions, so an encrypted-mode client "
                                   "cannot run; nothing was sent (pass non_sensitive=True only where your "
                                   "tenant's policy allows a plaintext fallback)") from exc

    def load_bundle(self, man: proto.Manifest) -> None:
        """The client's model and tokenizer from the (cached, SHA-256-checked) bundle."""
        from engine.tokenizer import Tokenizer
        from fhe.bundle import read_bundle

        path = self.cache_dir / "bundles" / f"{man.bundle_sha256}.safetensors"
        if not path.exists() or _sha256(path) != man.bundle_sha256:
            data = self.exchange(proto.bundle_call()).content
            if hashlib.sha256(data).hexdigest() != man.bundle_sha256:
                raise PrivateModeError("downloaded bundle does not match the manifest's SHA-256")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        model, meta = read_bundle(path, path.with_suffix(".files"))
        info = self.offload_info
        if meta["plan_hash"] != (info.plan_hash if info is not None else man.plan_hash):
            raise PrivateModeError("bundle was built for another plan")
        self.layers = man.encrypted_layers
        self.model = client_model(model, self.layers)
        if info is not None:
            from client_sdk._offload import OffloadClient

            self.offload = OffloadClient(self, info)
            self.offload.install(self.model)
        self.tokenizer = Tokenizer.from_folder(path.with_suffix(".files"))

    def make_keys(self, man: proto.Manifest) -> None:
        """CKKS keys for the plan (the secret stays in ``self.ckks``); the public part registered once."""
        from fhe.attention import BlockClient, required_key_levels
        from fhe.params import CKKSParams

        params = CKKSParams.from_dict(man.ckks)
        # each key at the level where the server's blocks use it (what the server requires)
        levels = functools.reduce(lambda a, b: a.merge(b), (required_key_levels(self.model.config, params, kind, sq)
                                                            for kind, sq in sorted(set(man.approx.values()))))
        self.ckks, upload = self._key_set(params, levels)
        self.blocks = {i: BlockClient.for_model(self.ckks, self.model.config, kind, sq)
                       for i, (kind, sq) in man.approx.items()}
        self.fingerprint = hashlib.sha256(upload).hexdigest()
        self.key_bytes = len(upload)
        self.upload_bytes = 0
        if proto.key_is_registered(self.exchange(proto.KEYS).json(), self.fingerprint):
            return  # the server holds this key already: nothing to upload
        reply = self.exchange(proto.key_upload_call(man, self.key_id, upload, self.read_floor))
        proto.check_registered(reply.json(), self.fingerprint)
        self.upload_bytes = len(upload)

    def _key_set(self, params: Any, levels: Any) -> tuple[Any, bytes]:
        """(CKKSClient, upload bytes): from the key store when it holds a fitting key, else generated.

        ``levels`` is the plan's :class:`fhe.params.KeyLevels`. A stored key set without level-aware keys
        (an older SDK's) does not fit and is refused by the server; it is reported, never uploaded."""
        from client_sdk._keystore_errors import KeyStoreNotFoundError
        from client_sdk.keystore import KeyMaterial
        from fhe import wire
        from fhe.ckks import CKKSClient
        from fhe.envelope import pack_key_upload, parse_key_upload

        made: list[CKKSClient] = []
        steps = levels.steps

        def generate() -> KeyMaterial:
            self._report("key generation", 0, len(steps), "")
            made.append(CKKSClient(params, steps, levels=levels))
            self._report("key generation", len(steps), len(steps), "")
            return KeyMaterial(made[0].unsafe_export_secret(), pack_key_upload(wire.dump_public_keys(made[0])))

        if self.key_store is None:
            material = generate()
            return made[0], material.public
        try:
            handle = self.key_store.key(self.key_id)
        except KeyStoreNotFoundError:
            handle = self.key_store.generate(generate, key_id=self.key_id)
            return made[0], handle.public_material()
        upload = handle.public_material()
        blobs = wire.unpack_public_keys(parse_key_upload(upload, 1 << 34), params)
        if set(blobs) != set(wire.expected_blobs(levels)):
            raise PrivateModeError(f"the key store's key {self.key_id!r} was made without the level-aware keys "
                                   "this plan needs; use another key id or delete it to generate a new one")
        return CKKSClient.restore(params, steps, handle.secret_material(), blobs, levels=levels), upload

    def _report(self, stage: str, done: int, total: int | None, unit: str = "B") -> None:
        if self.progress is not None:
            self.progress(proto.Progress(stage, done, total, unit))

    # -- sessions -------------------------------------------------------------------------------------
    def open_session(self) -> str:
        """Open a session on the registered key (closing the previous one)."""
        self.close_session()
        session = (self.offload.session(self.manifest) if self.offload is not None else
                   proto.Session(self.manifest, self.key_id, self.fingerprint, self.key_bytes, self.read_floor))
        sid = session.opened(self.exchange(session.open_call()))
        self.session = session
        return sid

    def close_session(self) -> None:
        """Free the server's session (errors ignored: it may be gone already)."""
        from client_sdk._exceptions import CipherlmError

        call = self.session.close_call() if self.session is not None else None
        self.session = None
        if call is not None:
            try:
                self.exchange(call)
            except CipherlmError:
                pass

    def encrypted_attention(self, layer: int, start: int, x_normed: torch.Tensor,
                            stats: StepStats) -> torch.Tensor:
        """One server step: encrypted attention of ``layer`` for positions start.. (x̂ [T, hidden] -> [T, hidden])."""
        from fhe import wire
        from fhe.errors import FHEError

        block, count = self.blocks[layer], len(x_normed)
        verify = self.verifying
        packed = not verify and self._packs(start, count)
        rows = block.layout_packed(x_normed) if packed else [block.layout_input(row) for row in x_normed]
        zeros = self._zeros()
        if zeros is None:
            seeded = self.manifest.upload != "full"   # full: the server's GPU workers parse them without SEAL
            blobs = tuple(wire.encrypt_to_wire(self.ckks, vec, seeded=seeded) for vec in rows)
        else:
            blobs = tuple(zeros.encrypt_to_wire(vec) for vec in rows)
        call = self.session.step_call(layer, start, blobs, count if packed else None, verify=verify)
        if zeros is not None:
            zeros.prefetch()   # the next step's encryption of zero is made while this one is on the server
        t0 = time.perf_counter()
        reply = self.exchange(call)
        stats.seconds += time.perf_counter() - t0
        stats.bytes_up += len(call.content)
        stats.bytes_down += len(reply.content)
        stats.steps += 1
        out = self.session.step_result(reply, layer, start, count)
        try:
            cts = [wire.load_ciphertext(b, self.ckks.kit, self.ckks.fingerprint) for b in out]
            return block.finish(*block.decrypt_output(cts))
        except FHEError as exc:   # garbage, another key, or an output out of range: never a silent token
            raise PrivateModeError(f"layer {layer}: unusable server answer ({type(exc).__name__}: {exc})") from exc

    def _zeros(self) -> Any:
        """The encryptions of zero made ahead (:mod:`client_sdk._zeros`) of the current key set, in the upload form
        the manifest asks for; None with an offload plan (its crypto pool forks) or when :attr:`zeros_ahead` is
        off."""
        if self.offload is not None or not self.zeros_ahead:
            return None
        seeded = self.manifest.upload != "full"
        if (self._zeros_ahead is None or self._zeros_ahead.ckks is not self.ckks
                or self._zeros_ahead.seeded != seeded):                 # a new key set: new zeros
            from client_sdk._zeros import ZerosAhead

            if self._zeros_ahead is not None:
                self._zeros_ahead.close()
            self._zeros_ahead = ZerosAhead(self.ckks, seeded)
        return self._zeros_ahead

    def _chunk(self) -> int:
        return self.manifest.packed_chunk if getattr(self, "packed_prefill", True) else 0

    def _packs(self, start: int, count: int) -> bool:
        """Send a prefill as packed chunks when the server takes them (manifest), the step starts at a
        cache block boundary and it fills at least half a chunk: a packed chunk's projection costs the
        same for 1 token as for B (docs/fhe.md §3a), so a short tail goes one ciphertext per token."""
        chunk = self._chunk()
        return chunk > 0 and start % chunk == 0 and count >= max(2, chunk // 2)

    def _steps(self, start: int, count: int) -> list[tuple[int, int]]:
        """(offset, length) of the steps for ``count`` positions from ``start``: at most
        ``max_step_tokens`` each; when packing, whole chunks per step and a short tail on its own."""
        step, chunk = self.manifest.max_step_tokens, self._chunk()
        if not 0 < chunk <= step or start % chunk:
            return [(s, min(step, count - s)) for s in range(0, count, step)]
        step -= step % chunk
        out = []
        for s in range(0, count, step):
            n = min(step, count - s)
            whole = n - n % chunk
            if whole and whole < n and not self._packs(start + s + whole, n - whole):
                out += [(s, whole), (s + whole, n - whole)]   # the tail is not worth a packed chunk
            else:
                out.append((s, n))
        return out

    # kept for callers of the first runtime (the e2e test drives single steps)
    _attention = encrypted_attention

    # -- generation: the engine's forward, sampler and output processor ---------------------------------
    def max_len(self) -> int:
        """Positions one generation may use: the session's bound, the model's and the tenant's context."""
        bound = min(self.manifest.max_session_tokens, self.model.config.max_position_embeddings)
        ctx = self._tenant_limit("max_context_tokens")
        return min(bound, ctx) if ctx else bound

    def tenant_max_tokens(self) -> int | None:
        """The tenant's ``max_tokens`` limit (``GET /v1/tenant``), which caps and sets chat defaults."""
        return self._tenant_limit("max_tokens")

    def _tenant_limit(self, name: str) -> int | None:
        if self._tenant_limits is None:
            body = self.exchange(proto.TENANT).json()
            limits = body.get("limits") if isinstance(body, dict) else None
            self._tenant_limits = dict(limits) if isinstance(limits, dict) else {}
        value = self._tenant_limits.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def generate(self, prompt_ids: list[int], params: Any) -> Iterator[PrivateToken]:
        """Stream tokens for ``prompt_ids`` under ``params`` (an ``engine.SamplingParams``)."""
        self.prepare()
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_len():
            raise PrivateModeError(f"prompt + max_tokens = {total} exceeds the server's session limit "
                                   f"{self.max_len()}")
        self.thread_scope.choose(self.threads)
        run = _Generation(self, list(prompt_ids), params)
        try:  # a stream left early, or an error, still closes the server's session
            yield from run.tokens()
        finally:
            self.close_session()

    @torch.inference_mode()
    def forward(self, backend: EncryptedBackend, ids: list[int], start: int) -> torch.Tensor:
        """Run positions start.. through the model in steps the server accepts; last position's logits [vocab]."""
        logits = None
        with threads_of(self, len(ids)):   # decode steps (one row) only: client_sdk._threads
            for s, n in self._steps(start, len(ids)):
                chunk = torch.tensor(ids[s:s + n])
                pos = torch.arange(start + s, start + s + len(chunk))
                if getattr(self, "offload", None) is not None:   # its MLP steps: this chunk's position, stats
                    self.offload.start, self.current_stats = start + s, backend.stats
                h = self.model(chunk, pos, backend)  # engine.model forward; encrypted layers call the server
                backend.cache.advance()
                logits = self.model.logits(h[-1:])[0]
        return logits


class _Generation:
    """One request through the engine's pieces: Request/Sequence state, Sampler, OutputProcessor."""

    def __init__(self, runtime: PrivateRuntime, prompt_ids: list[int], params: Any) -> None:
        from engine.output_processor import OutputProcessor
        from engine.sampler import Sampler
        from engine.sequence import Request, Sequence

        self.rt, self.params = runtime, params
        eos = list(runtime.model.config.eos_token_ids)
        if runtime.tokenizer.eos_token_id is not None:
            eos.append(runtime.tokenizer.eos_token_id)
        self.out = OutputProcessor(runtime.tokenizer, eos, runtime.max_len())
        self.request = Request(f"priv-{next(_REQUEST_IDS)}", prompt_ids, params, time.time())
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.seq = Sequence(0, self.request, 0, prompt_ids, gen)
        self.request.seqs.append(self.seq)
        self.sampler = Sampler(torch.Generator().manual_seed(0))

    def tokens(self) -> Iterator[PrivateToken]:
        from client_sdk._speculate import Speculation

        spec = self.rt.last_speculation = Speculation.for_request(self.rt, self.params)
        if spec is not None:
            yield from spec.tokens(self)
            return
        stats = StepStats()
        backend, logits = self._replay(stats)
        while True:
            tok = self.sample(logits, stats)
            yield tok
            if tok.finish_reason is not None:
                return
            stats = StepStats()
            logits = self._step(backend, stats)

    def sample(self, logits: torch.Tensor, stats: StepStats) -> PrivateToken:
        """The next token from its logits [vocab], appended to the sequence."""
        from engine.sampler import SamplingRow

        seq = self.seq
        row = SamplingRow(self.params, self.request.prompt_token_ids, seq.output_token_ids, seq.generator)
        result = self.sampler(logits[None], [row])
        return self.emit(result.token_ids[0], result.logprobs[0], stats)

    def emit(self, tok: int, lp: dict[int, float] | None, stats: StepStats) -> PrivateToken:
        """Append a chosen token (finish rules applied) and return it with its stream delta."""
        from engine.sequence import SequenceStatus

        seq = self.seq
        self.out.append_token(seq, tok, lp)
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
        c = self.out.build(self.request).outputs[0]
        return PrivateToken(tok, c.delta_text, c.finish_reason, stats, lp)

    def _replay(self, stats: StepStats) -> tuple[EncryptedBackend, torch.Tensor]:
        """A fresh session and cache, with every token so far run through from position 0."""
        from engine.model import DenseKVCache

        self.rt.open_session()
        backend = EncryptedBackend(self.rt, DenseKVCache(self.rt.model.config, self.rt.max_len()), stats)
        return backend, self.rt.forward(backend, self.seq.token_ids, 0)

    def _step(self, backend: EncryptedBackend, stats: StepStats) -> torch.Tensor:
        """The newest token's logits; a lost session is replaced and the positions so far replayed."""
        ids = self.seq.token_ids
        backend.stats = stats
        try:
            return self.rt.forward(backend, ids[-1:], len(ids) - 1)
        except Exception as exc:
            if not proto.Session.lost(exc):
                raise
        new_backend, logits = self._replay(stats)
        backend.cache = new_backend.cache
        return logits


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
