"""The state of one worker process: the plan's encrypted layers, loaded keys, per-session KV caches.

Runs only inside :mod:`server.private.workers` processes: every byte from a client is parsed here
(the SEAL backend's wire checks sizes, parameter hashes and key fingerprints before SEAL parses). The methods are
the worker's task names.
"""

from __future__ import annotations

import functools

import torch

from fhe.attention import EncryptedAttentionLayer, EncryptedKVCache
from fhe.backends.seal import wire
from fhe.backends.seal.keys import ServerKeys
from fhe.envelope import EnvelopeError, parse_key_upload
from fhe.errors import FHEError, KeyMismatchError, SecretKeyRefusedError, ShapeError, WireError
from fhe.fingerprint import params_hash
from fhe.params import CKKSParams, KeyLevels
from fhe.plan import Plan


class PrivateCompute:
    """Server half of the plan's encrypted attention blocks (no secret key ever reaches it)."""

    def __init__(self, model_dir: str, plan_path: str, max_tokens: int) -> None:
        from engine.loader import load_model

        torch.set_num_threads(1)  # one core per worker: parallelism comes from the pool
        model = load_model(model_dir)
        plan = Plan.load(plan_path)
        plan.check_model(model)
        self.params = CKKSParams.from_dict(plan.ckks)
        self.layers = {i: EncryptedAttentionLayer(model.model.layers[i], model.rotary, plan.layer(i), model.config,
                                                  self.params, max_tokens) for i in plan.layer_indices}
        # level-aware keys (docs/protocol.md): uploads must carry each key at the level the blocks use it
        self.key_levels = functools.reduce(KeyLevels.merge, (layer.key_levels for layer in self.layers.values()))
        self.steps = list(self.key_levels.steps)
        self.max_key_bytes = 1 << 30
        self.keys: dict[str, ServerKeys] = {}
        self.sessions: dict[str, tuple[str, dict[int, EncryptedKVCache]]] = {}

    # -- keys --------------------------------------------------------------------------------------
    def _parse_keys(self, data: bytes) -> ServerKeys:
        try:
            blobs = parse_key_upload(data, self.max_key_bytes)
        except EnvelopeError:
            wire.refuse_private_tenseal_context(data)  # a TenSEAL context with a secret key: refused as such
            raise
        return wire.load_server_keys(blobs, self.params, self.key_levels)

    def inspect_key(self, data: bytes) -> tuple[bool, str, str]:
        """(carries a secret key, parameters hash, why it does not fit the plan or ''); raises if garbage."""
        try:
            self._parse_keys(data)
        except SecretKeyRefusedError:
            return True, "", ""
        except KeyMismatchError as exc:
            return False, "", str(exc)
        except (EnvelopeError, WireError) as exc:
            raise WireError(f"not a public-key upload: {exc}") from exc
        return False, params_hash(self.params), ""

    def load_key(self, fingerprint: str, data: bytes) -> None:
        """Parse a registered upload (already screened) and keep it under its registry fingerprint."""
        self.keys[fingerprint] = self._parse_keys(data)

    def drop_key(self, fingerprint: str) -> int:
        """Forget a key and every session that used it; returns the sessions dropped."""
        self.keys.pop(fingerprint, None)
        doomed = [sid for sid, (fp, _) in self.sessions.items() if fp == fingerprint]
        for sid in doomed:
            del self.sessions[sid]
        return len(doomed)

    # -- sessions ------------------------------------------------------------------------------------
    def open_session(self, sid: str, fingerprint: str) -> None:
        if fingerprint not in self.keys:
            raise KeyMismatchError("key not loaded in this worker")
        self.sessions[sid] = (fingerprint, {i: layer.new_cache() for i, layer in self.layers.items()})

    def close_session(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def step(self, sid: str, fingerprint: str, layer: int, start: int, blobs: list[bytes]) -> tuple[list[bytes], int]:
        """Run ``layer`` over positions start.. for the session; returns (result blobs, session bytes)."""
        if sid not in self.sessions:
            raise ShapeError("unknown session in this worker")
        fp, caches = self.sessions[sid]
        if fp != fingerprint:
            raise KeyMismatchError("session belongs to another key")
        keys, block = self.keys[fp], self.layers[layer]
        cache = caches[layer]
        if cache.length != start:
            raise ShapeError(f"layer {layer} holds {cache.length} positions, step starts at {start}")
        cts = [wire.load_ciphertext(b, keys.kit, keys.fingerprint, level=block.ev.top) for b in blobs]
        outs = block.prefill(cache, cts, start, keys)
        out = [wire.dump_ciphertext(c, self.params, keys.fingerprint) for c in outs]
        return out, sum(c.nbytes() for c in caches.values())


def make_state(model_dir: str, plan_path: str, max_tokens: int) -> PrivateCompute:
    """Worker factory (``server.private.workers`` imports it by name)."""
    return PrivateCompute(model_dir, plan_path, max_tokens)


__all__ = ["FHEError", "PrivateCompute", "make_state"]
