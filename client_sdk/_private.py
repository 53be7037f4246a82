"""Private (encrypted) generation on the client: local layers, CKKS encryption, server steps, sampling.

Text, token ids and plaintext activations never leave this process. Per generated token, for each
encrypted layer the client sends the encrypted RMS-normalized residual of the new position and gets
back encrypted per-head numerators ``y_h`` and denominators ``z_h``; it decrypts, computes
``sum_h y_h / z_h``, adds the residual and runs the layer's MLP (and every other layer) itself.

Robustness: a step that fails with a transient error is retried (the server answers a repeated step from
its record); a lost session (worker restart, TTL) is replaced by a new one on the same registered key,
and the positions so far are replayed — keys are never uploaded again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from client_sdk._exceptions import APIStatusError, CipherlmError, NotFoundError, PrivacyModeError

if TYPE_CHECKING:
    from client_sdk._client import Client

OCTET = {"Content-Type": "application/octet-stream"}
_SESSION_LOST = {"session_lost", "session_closed", "session_not_found"}


class PrivateModeError(CipherlmError):
    """The private runtime cannot proceed (bad bundle, plan changed, unusable key)."""


@dataclasses.dataclass
class StepStats:
    """Wire and time accounting of one generated token (all encrypted layers)."""

    seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    steps: int = 0


@dataclasses.dataclass
class PrivateToken:
    """One streamed token of a private generation."""

    token_id: int
    text: str
    finish_reason: str | None
    stats: StepStats


class PrivateRuntime:
    """The client half of the server's plan: bundle model, tokenizer, CKKS keys, one session at a time.

    Args:
        client: a :class:`client_sdk.Client` (its key, base URL, timeouts, retries and error mapping).
        key_id: name of the registered key.
        cache_dir: where verified bundles are kept (default ``$CIPHERLM_HOME/client``).
        key_store: an open :class:`client_sdk.KeyStore`: the CKKS key set is kept there (secret encrypted
            at rest) and reused across processes, and uploaded only if the server does not hold it yet.
            None: a fresh key set per runtime.
    """

    def __init__(self, client: Client, key_id: str = "sdk", cache_dir: str | Path | None = None,
                 key_store: Any = None) -> None:
        self.client, self.key_id, self.key_store = client, key_id, key_store
        if cache_dir is None:
            from engine.default_model import cipherlm_home

            cache_dir = cipherlm_home() / "client"
        self.cache_dir = Path(cache_dir)
        self.manifest: dict[str, Any] | None = None
        self.session: str | None = None
        self.upload_bytes = 0

    # -- setup -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Manifest, bundle (downloaded once, verified by SHA-256), keys generated or loaded, registered."""
        if self.manifest is not None:
            return
        try:
            man = self.client._json(self.client._request("GET", "/v1/private/manifest"))
        except NotFoundError as exc:
            raise PrivacyModeError("this server offers no encrypted sessions, so an encrypted-mode client "
                                   "cannot run; nothing was sent (pass non_sensitive=True only where your "
                                   "tenant's policy allows a plaintext fallback)") from exc
        self._load_bundle(man)
        self._make_keys(man)
        self.manifest = man

    def _load_bundle(self, man: dict[str, Any]) -> None:
        from engine.tokenizer import Tokenizer
        from fhe.bundle import read_bundle

        sha = man["bundle"]["sha256"]
        path = self.cache_dir / "bundles" / f"{sha}.safetensors"
        if not path.exists() or _sha256(path) != sha:
            data = self.client._request("GET", "/v1/private/bundle").content
            if hashlib.sha256(data).hexdigest() != sha:
                raise PrivateModeError("downloaded bundle does not match the manifest's SHA-256")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        self.model, meta = read_bundle(path, path.with_suffix(".files"))
        if meta["plan_hash"] != man["plan_hash"]:
            raise PrivateModeError("bundle was built for another plan")
        self.tokenizer = Tokenizer.from_folder(path.with_suffix(".files"))
        self.layers = tuple(man["layers"]["encrypted_attention"])

    def _make_keys(self, man: dict[str, Any]) -> None:
        from fhe.attention import BlockClient, required_rotation_steps
        from fhe.params import CKKSParams

        params = CKKSParams.from_dict(man["ckks"])
        approx = {lp["index"]: lp["approx"] for lp in man["plan"]["layers"]}
        steps: set[int] = set()
        for kind, sq in {(a["kind"], a["squarings"]) for a in approx.values()}:
            steps |= set(required_rotation_steps(self.model.config, params, kind, sq))
        self.ckks, upload = self._key_set(params, tuple(sorted(steps)))  # the secret key stays in self.ckks
        self.blocks = {i: BlockClient.for_model(self.ckks, self.model.config, a["kind"], a["squarings"])
                       for i, a in approx.items()}
        self.fingerprint = hashlib.sha256(upload).hexdigest()
        self.upload_bytes = len(upload)
        listed = self.client._json(self.client._request("GET", "/v1/private/keys"))["data"]
        if any(k["fingerprint"] == self.fingerprint and k["state"] == "active" for k in listed):
            self.upload_bytes = 0  # the server holds this key already: nothing to upload
            return
        rec = self.client._json(self.client._request("POST", f"/v1/private/keys/{self.key_id}",
                                                     content=upload, headers=OCTET))
        if rec["fingerprint"] != self.fingerprint:
            raise PrivateModeError("server registered another fingerprint than the one uploaded")

    def _key_set(self, params: Any, steps: tuple[int, ...]) -> tuple[Any, bytes]:
        """(CKKSClient, upload bytes): from the key store when it holds a fitting key, else generated."""
        from client_sdk._keystore_errors import KeyStoreNotFoundError
        from client_sdk.keystore import KeyMaterial
        from fhe import wire
        from fhe.ckks import CKKSClient
        from fhe.envelope import pack_key_upload, parse_key_upload

        made: list[CKKSClient] = []

        def generate() -> KeyMaterial:
            made.append(CKKSClient(params, steps))
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
        return CKKSClient.restore(params, steps, handle.secret_material(), blobs), upload

    # -- sessions -------------------------------------------------------------------------------------
    def open_session(self) -> str:
        body = {"key_id": self.key_id, "plan_hash": self.manifest["plan_hash"]}
        self.session = self.client._json(self.client._request("POST", "/v1/private/sessions", json=body))["session_id"]
        return self.session

    def close_session(self) -> None:
        if self.session is not None:
            sid, self.session = self.session, None
            try:
                self.client._request("DELETE", f"/v1/private/sessions/{sid}")
            except (APIStatusError, NotFoundError):
                pass

    def _attention(self, layer: int, start: int, x_normed: torch.Tensor, stats: StepStats) -> torch.Tensor:
        """The encrypted attention of ``layer`` for positions start.. (x̂ [T, hidden] -> attn_out [T, hidden])."""
        from fhe import wire
        from fhe.envelope import Envelope, parse
        from fhe.errors import FHEError

        block = self.blocks[layer]
        blobs = tuple(wire.encrypt_to_wire(self.ckks, block.layout_input(row)) for row in x_normed)
        kind = "decode" if len(blobs) == 1 and start > 0 else "prefill"
        body = Envelope(self.session, self.fingerprint, layer, kind, (start, len(blobs)), blobs).to_bytes()
        t0 = time.perf_counter()
        resp = self.client._request("POST", f"/v1/private/sessions/{self.session}/steps", content=body,
                                    headers=OCTET)
        stats.seconds += time.perf_counter() - t0
        stats.bytes_up += len(body)
        stats.bytes_down += len(resp.content)
        stats.steps += 1
        env = parse(resp.content, 1 << 30, 1 << 34)
        if env.positions != (start, len(blobs)) or env.layer != layer:
            raise PrivateModeError("server answered another step")
        try:
            cts = [wire.load_ciphertext(b, self.ckks.kit, self.ckks.fingerprint) for b in env.blobs]
            y, z = block.decrypt_output(cts)
            return block.finish(y, z)
        except FHEError as exc:   # garbage, another key, or an output out of range: never a silent token
            raise PrivateModeError(f"layer {layer}: unusable server answer ({type(exc).__name__}: {exc})") from exc

    # -- generation --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, cache, ids: list[int], start: int, stats: StepStats) -> torch.Tensor:
        """Run positions start.. through every layer; returns the last position's logits [vocab]."""
        model = self.model
        step = int(self.manifest["limits"]["max_step_tokens"])
        logits = None
        for s in range(0, len(ids), step):
            chunk = ids[s:s + step]
            pos = torch.arange(start + s, start + s + len(chunk))
            h = model.embed(torch.tensor(chunk))
            for i, layer in enumerate(model.layers):
                if i in self.layers:
                    attn = self._attention(i, start + s, layer.input_layernorm.normalize(h), stats)
                    h = layer.mlp_block(h + attn.to(h.dtype))
                else:
                    h = layer(h, pos, model.rotary, cache)
            cache.advance()
            logits = model.logits(h[-1:])[0]
        return logits

    def generate(self, prompt_ids: list[int], params: Any) -> Iterator[PrivateToken]:
        """Stream tokens for ``prompt_ids`` under ``params`` (an ``engine.SamplingParams``)."""
        from engine.sampler import Sampler, SamplingRow

        self.prepare()
        max_len = len(prompt_ids) + params.max_tokens
        if max_len > int(self.manifest["limits"]["max_session_tokens"]):
            raise PrivateModeError(f"prompt + max_tokens = {max_len} exceeds the server's session limit "
                                   f"{self.manifest['limits']['max_session_tokens']}")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        row = SamplingRow(params, list(prompt_ids), [], gen)
        sampler = Sampler(torch.Generator().manual_seed(0))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.model.config.eos_token_ids)
            if self.tokenizer.eos_token_id is not None:
                stop_ids.add(self.tokenizer.eos_token_id)
        detok = self.tokenizer.detokenizer(list(prompt_ids), params.skip_special_tokens)
        stats = StepStats()
        try:  # a stream left early, or an error, still closes the server's session
            cache, logits = self._replay(list(prompt_ids), max_len, stats)
            text = ""
            while True:
                tok = sampler(logits[None], [row]).token_ids[0]
                row.output_token_ids.append(tok)
                finish = _finish_reason(tok, stop_ids, row, params)
                delta = "" if finish == "stop" and tok in stop_ids else detok.step([tok])
                text, delta, stopped = _apply_stop(text, delta, params.stop)
                yield PrivateToken(tok, delta, "stop" if stopped else finish, stats)
                if finish or stopped:
                    return
                stats = StepStats()
                logits = self._step_with_replay(cache, row, max_len, stats)
        finally:
            self.close_session()

    def _replay(self, ids: list[int], max_len: int, stats: StepStats):
        """A fresh session and cache, with ``ids`` run through from position 0."""
        from engine.model import DenseKVCache

        self.close_session()
        self.open_session()
        cache = DenseKVCache(self.model.config, max_len)
        return cache, self._forward(cache, ids, 0, stats)

    def _step_with_replay(self, cache, row, max_len: int, stats: StepStats) -> torch.Tensor:
        ids = row.prompt_token_ids + row.output_token_ids
        try:
            return self._forward(cache, ids[-1:], len(ids) - 1, stats)
        except APIStatusError as exc:
            if exc.code not in _SESSION_LOST and exc.status_code not in (410, 503):
                raise
        new_cache, logits = self._replay(ids, max_len, stats)
        cache.__dict__.update(new_cache.__dict__)
        return logits


def _finish_reason(tok: int, stop_ids: set[int], row, params) -> str | None:
    if tok in stop_ids:
        return "stop"
    if len(row.output_token_ids) >= params.max_tokens:
        return "length"
    return None


def _apply_stop(text: str, delta: str, stops: list[str]) -> tuple[str, str, bool]:
    """Cut the stream at the first stop string (never emitting text past it)."""
    new = text + delta
    for s in stops:
        i = new.find(s)
        if i != -1:
            return new[:i], new[len(text):i] if i > len(text) else "", True
    return new, delta, False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# --- the OpenAI-style surface of an encrypted-mode Client ------------------------------------------------
_UNSUPPORTED = ("n", "logprobs", "top_logprobs", "best_of", "echo", "suffix")


class PrivateStream:
    """Iterator of completion chunks from a private generation (same surface as ``Stream``)."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks

    def __iter__(self) -> Iterator[Any]:
        return self._chunks

    def __next__(self) -> Any:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def __enter__(self) -> PrivateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sampling_params(body: dict[str, Any]) -> Any:
    """``engine.SamplingParams`` from an OpenAI-style body (OpenAI's defaults where it has them)."""
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams

    for name in _UNSUPPORTED:
        if body.get(name) not in (None, 1, False):
            raise PrivateModeError(f"{name!r} is not supported in encrypted mode")
    stop = body.get("stop") or []
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise PrivateModeError("'skip_special_tokens' must be true or false")
    try:
        return SamplingParams(max_tokens=body.get("max_tokens") or 16, temperature=body.get("temperature", 1.0),
                              top_p=body.get("top_p", 1.0), top_k=body.get("top_k") or -1,
                              seed=body.get("seed"), stop=[stop] if isinstance(stop, str) else list(stop),
                              presence_penalty=body.get("presence_penalty") or 0.0,
                              frequency_penalty=body.get("frequency_penalty") or 0.0,
                              skip_special_tokens=skip)
    except InvalidRequestError as exc:
        raise PrivateModeError(str(exc)) from exc


def private_call(client: Client, path: str, body: dict[str, Any], stream: bool) -> Any:
    """Serve ``POST path`` (completions or chat) through the private runtime of ``client``."""
    from engine.errors import InvalidRequestError

    if getattr(client, "_private", None) is None:
        client._private = PrivateRuntime(client, key_store=client.key_store)
    runtime = client._private
    runtime.prepare()
    chat = path.endswith("/chat/completions")
    try:
        if chat:
            ids = runtime.tokenizer.apply_chat_template(list(body["messages"]))
        elif isinstance(body.get("prompt"), str):
            ids = runtime.tokenizer.encode(body["prompt"])
        else:
            raise PrivateModeError("encrypted mode takes one string prompt")
    except InvalidRequestError as exc:
        raise PrivateModeError(str(exc)) from exc
    params = sampling_params(body)
    chunks = _chunks(runtime, ids, params, chat, runtime.manifest["model"])
    if stream:
        return PrivateStream(chunks)
    return _collect(list(chunks), chat, len(ids))


def _chunks(runtime: PrivateRuntime, ids: list[int], params: Any, chat: bool, model: str) -> Iterator[Any]:
    from client_sdk._types import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChoiceDelta,
        Completion,
        CompletionChoice,
    )

    rid, created = f"priv-{int(time.time() * 1000)}", int(time.time())
    for i, tok in enumerate(runtime.generate(ids, params)):
        if chat:
            delta = ChoiceDelta(role="assistant" if i == 0 else None, content=tok.text)
            yield ChatCompletionChunk(rid, created, model, [ChatChunkChoice(0, delta, tok.finish_reason)])
        else:
            yield Completion(rid, created, model, [CompletionChoice(0, tok.text, tok.finish_reason)])


def _collect(chunks: list[Any], chat: bool, prompt_tokens: int) -> Any:
    from client_sdk._types import ChatChoice, ChatCompletion, ChatMessage, Completion, CompletionChoice, Usage

    first, last = chunks[0], chunks[-1]
    usage = Usage(prompt_tokens, len(chunks), prompt_tokens + len(chunks))
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        choice = ChatChoice(0, ChatMessage("assistant", text), last.choices[0].finish_reason)
        return ChatCompletion(first.id, first.created, first.model, [choice], usage)
    text = "".join(c.choices[0].text for c in chunks)
    return Completion(first.id, first.created, first.model,
                      [CompletionChoice(0, text, last.choices[0].finish_reason)], usage)


class AsyncPrivateStream:
    """Async iterator over a private generation that runs in a worker thread (CKKS work is blocking)."""

    def __init__(self, stream: PrivateStream) -> None:
        self._stream = stream

    def __aiter__(self) -> AsyncPrivateStream:
        return self

    async def __anext__(self) -> Any:
        import asyncio

        chunk = await asyncio.to_thread(next, self._stream, None)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def close(self) -> None:
        import asyncio

        await asyncio.to_thread(self._stream.close)

    async def __aenter__(self) -> AsyncPrivateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def async_private_call(client: Any, path: str, body: dict[str, Any], stream: bool) -> Any:
    """The encrypted path of an ``AsyncClient``: a blocking twin ``Client`` driven from a thread."""
    import asyncio

    from client_sdk._client import Client

    if getattr(client, "_private_twin", None) is None:
        client._private_twin = Client(api_key=client.api_key, base_url=client.base_url, timeout=client.timeout,
                                      max_retries=client.retry.max_retries, privacy="encrypted",
                                      key_store=client.key_store)
    result = await asyncio.to_thread(private_call, client._private_twin, path, body, stream)
    return AsyncPrivateStream(result) if stream else result
