"""Encryptions of zero made ahead, on one background thread, while the client waits for the server.

An attention step's upload is on the client's critical path: encode, encrypt, serialize, then wait for the
server's answer. SEAL's symmetric encryption is an encryption of zero (uniform c1 from a fresh seed, c0 = -c1·s
+ e) with the encoded message added to c0 (:meth:`fhe.backends.seal.keys.CKKSClient.encrypt_onto`), and the
zero, its costly half (~30 ms of the ~60 ms at N = 32768 on this project's 2-core box), needs no message: it is
made here while the previous step is on the server, and the step then only encodes, adds and serializes.

Only for full uploads (the manifest's ``upload = "full"``; SEAL's seeded form is made by SEAL's own encryption
call). Each zero serves exactly one message: it is taken off the queue, and a zero that carries a message
already is refused (``encrypt_onto``). The zeros never leave this process's memory; they are made under the
same secret key the runtime holds, by the same SEAL calls as :meth:`~fhe.backends.seal.keys.CKKSClient.encrypt`'s.

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

    def __init__(self, ckks: Any) -> None:
        self.ckks = ckks
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckks-zeros")
        self._ready: collections.deque[Future] = collections.deque()
        #: zeros taken from the queue / made in the caller's thread because none was queued (the benchmarks read them)
        self.taken = 0
        self.inline = 0

    def encrypt_to_wire(self, values: Any) -> bytes:
        """``values`` as a full wire blob (:func:`fhe.backends.seal.wire.encrypt_to_wire`), on a zero made ahead
        if one is queued (waiting for it if it is still being made), else on one made now."""
        from fhe import wire

        if self._ready:
            zero = self._ready.popleft().result()
            self.taken += 1
        else:
            zero = self.ckks.encrypt_zero()
            self.inline += 1
        return wire.encrypt_to_wire(self.ckks, values, seeded=False, zero=zero)

    def prefetch(self, count: int = 1) -> None:
        """Have ``count`` zeros queued (made on the thread from now on)."""
        while len(self._ready) < count:
            self._ready.append(self._pool.submit(self.ckks.encrypt_zero))

    def close(self) -> None:
        """Drop the queued zeros and end the thread (after the zero it may be making)."""
        for fut in self._ready:
            fut.cancel()
        self._ready.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
