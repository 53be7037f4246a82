"""Encryptions of zero made ahead, on one background thread, while the client waits for the server.

An attention step's upload is on the client's critical path: encode, encrypt, serialize, then wait for the
server's answer. SEAL's symmetric encryption is an encryption of zero (uniform c1 from a fresh seed, c0 = -c1·s
+ e) with the encoded message added to c0, and the zero, its costly half, needs no message: it is made here while
the previous step is on the server, and the step then only encodes, adds and serializes.

Both upload forms (the manifest's ``upload``): seeded (the default, half the bytes: SEAL's seeded zero, c0 and the
seed parsed here, and :meth:`~fhe.backends.seal.keys.CKKSClient.encrypt_onto_seeded` writes c0 + the message and
the seed, the bytes SEAL's seeded encryption writes for that zero) and full (``upload = "full"``:
:meth:`~fhe.backends.seal.keys.CKKSClient.encrypt_onto`). Each zero serves exactly one message: it is taken off
the queue, and a zero that carries a message already is refused. The zeros never leave this process's memory;
they are made under the same secret key the runtime holds, by the same SEAL calls as the encryption's own.

``tenseal.sealapi`` holds the GIL during a call, so the thread's work overlaps only the time this process waits
(the HTTP answer); a zero still in progress when the answer arrives delays the main thread by what is left of
it. Not used with an offload plan, whose crypto pool forks: a fork while this thread is inside SEAL could copy
one of its locks held (:mod:`client_sdk._crypto_pool`).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ZerosAhead:
    """Encryptions of zero of one key set (a ``CKKSClient``), made ahead on one thread."""

    def __init__(self, ckks: Any, seeded: bool = True) -> None:
        self.ckks, self.seeded = ckks, seeded
        self._make = ckks.encrypt_zero_seeded if seeded else ckks.encrypt_zero
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckks-zeros")
        self._ready: collections.deque[Future] = collections.deque()
        #: zeros taken from the queue / made in the caller's thread because none was queued (the benchmarks read them)
        self.taken = 0
        self.inline = 0

    def encrypt_to_wire(self, values: Any) -> bytes:
        """``values`` as a wire blob in this queue's form (:func:`fhe.backends.seal.wire.encrypt_to_wire`), on a
        zero made ahead if one is queued (waiting for it if it is still being made), else on one made now."""
        from fhe import wire

        if self._ready:
            zero = self._ready.popleft().result()
            self.taken += 1
        else:
            zero = self._make()
            self.inline += 1
        return wire.encrypt_to_wire(self.ckks, values, seeded=self.seeded, zero=zero)

    def prefetch(self, count: int = 1) -> None:
        """Have ``count`` zeros queued (made on the thread from now on)."""
        while len(self._ready) < count:
            self._ready.append(self._pool.submit(self._make))

    def close(self) -> None:
        """Drop the queued zeros and end the thread (after the zero it may be making)."""
        for fut in self._ready:
            fut.cancel()
        self._ready.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
