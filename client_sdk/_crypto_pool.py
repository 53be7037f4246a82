"""The client's CKKS work of a step of several ciphertexts, spread over forked processes.

A prefill step of the 28-layer offload plan encrypts ~36 ciphertexts and decrypts up to ~48 (N = 8192);
one at a time that was ~4 ms per encryption and ~3 ms per parse + decryption, about half of the TTFT on the
H200 machine (docs/benchmarks.md, issue 17 session 11). ``tenseal.sealapi`` holds the GIL, so threads do not
help; processes do.

The pool is **forked** after the key set exists: each child inherits the client's key holder (secret key
included) in its copy of this process's memory. The secret key is never pickled, written to a file or a
pipe, or sent anywhere: a task carries only a key-set token and the values to encrypt (or the server's
answer blobs to decrypt), and a result only wire blobs (or the decrypted values, this client's own data),
all over the pool's pipes between this process and its children. The children are daemonic: they end with
this process, and :meth:`CryptoPool.close` (or the pool's finalizer) ends them earlier.

Results are bit-identical to the serial path: the same SEAL calls on the same inputs; SEAL's encryption
randomness differs per call anyway (fresh seeds), and decryption is deterministic.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import weakref
from collections.abc import Sequence
from typing import Any

#: key holders by token, set in this process before a pool forks (children inherit them; a child the pool
#: forks again after a crash inherits them the same way); removed when their pool closes
_STATES: dict[int, tuple[Any, bool]] = {}
_TOKENS = itertools.count(1)

#: the most processes :func:`default_processes` picks: per step a prefill encrypts ~36 ciphertexts, so more
#: processes each get too few to pay for the hand-over
MAX_DEFAULT = 8
ENV = "CIPHERLM_CRYPTO_PROCESSES"


def default_processes() -> int:
    """``$CIPHERLM_CRYPTO_PROCESSES`` if set, else the cores this process may run on, at most
    :data:`MAX_DEFAULT` (1 on a one-core machine: today's serial path)."""
    env = os.environ.get(ENV)
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of processes, got {env[:16]!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT, cores))


def _encrypt(task: tuple[int, Any]) -> bytes:
    from fhe import wire

    token, values = task
    ckks, seeded = _STATES[token]
    return wire.encrypt_to_wire(ckks, values, seeded=seeded)


def _decrypt(task: tuple[int, bytes]) -> Any:
    from fhe import wire

    token, blob = task
    ckks, _ = _STATES[token]
    return ckks.decrypt(wire.load_ciphertext(blob, ckks.kit, ckks.fingerprint))


def _close(token: int, pool: Any) -> None:
    pool.terminate()
    _STATES.pop(token, None)


class CryptoPool:
    """``processes`` forked children holding ``ckks`` (a :class:`fhe.ckks.CKKSClient`): :meth:`encrypt` and
    :meth:`decrypt` of many ciphertexts at once, each child taking one contiguous share.

    Args:
        ckks: the key holder (its secret key stays in memory: inherited by fork, never sent).
        processes: children (>= 2; with 1 the caller keeps its serial path and makes no pool).
        seeded: encrypt in SEAL's seeded form (else full ciphertexts: manifest ``offload.mlp.upload``).
    """

    def __init__(self, ckks: Any, processes: int, seeded: bool = True) -> None:
        if processes < 2:
            raise ValueError("a crypto pool needs at least 2 processes (1 is the serial path)")
        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError("the client's crypto pool needs fork (the children inherit the secret key "
                               "in memory); set crypto_processes = 1 on this platform")
        self.processes = processes
        self.token = next(_TOKENS)
        _STATES[self.token] = (ckks, seeded)
        self._pool = multiprocessing.get_context("fork").Pool(processes)
        self._finalizer = weakref.finalize(self, _close, self.token, self._pool)

    def _map(self, fn: Any, items: Sequence[Any]) -> list:
        chunk = -(-len(items) // self.processes)
        return self._pool.map(fn, [(self.token, it) for it in items], chunksize=max(1, chunk))

    def encrypt(self, rows: Sequence[Any]) -> list[bytes]:
        """One wire blob per row of values (:func:`fhe.wire.encrypt_to_wire`), in order."""
        return self._map(_encrypt, rows)

    def decrypt(self, blobs: Sequence[bytes]) -> list[Any]:
        """The decrypted values of each answer blob (:func:`fhe.wire.load_ciphertext` then the key holder's
        ``decrypt``), in order; an answer that does not parse raises its :class:`fhe.errors.FHEError`."""
        return self._map(_decrypt, blobs)

    def close(self) -> None:
        """End the children now (idempotent)."""
        self._finalizer()


__all__ = ["CryptoPool", "default_processes"]
