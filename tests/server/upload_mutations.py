"""Malformed full (unseeded) uploads for the gpu backend's direct parse: one per way SEAL's load or the worker's
freshness check refuses a ciphertext (the offload plan's linear steps and the attention steps both read them)."""

from __future__ import annotations

import numpy as np


def full_upload_mutations(gpu, fingerprint: str, blob: bytes) -> dict[str, bytes]:
    """Full uploads of ``blob`` (a good one for ``gpu``'s parameters and key set ``fingerprint``) that are each
    wrong in one way SEAL's load or the freshness check refuses."""
    import struct

    from fhe.backends.gpu import sealio
    from fhe.backends.seal import wire

    params, n, top = gpu.params, gpu.params.poly_modulus_degree, gpu.top
    raw = sealio.read_ciphertext(wire.ciphertext_payload(blob, params, fingerprint), n, top)

    def wrap(r, **patch) -> bytes:
        payload = bytearray(sealio.write_ciphertext(r, compress=False))
        for off, value in patch.values():
            payload[16 + off:16 + off + len(value)] = value
        return wire.pack_ciphertext(bytes(payload), params, fingerprint)

    def data(arr):
        return sealio.RawCiphertext(raw.parms_id, raw.scale, arr, raw.correction_factor)

    over = raw.data.copy()
    over[1, 0, 7] = gpu.ctx.primes[0]                   # a residue equal to its prime
    lower = raw.data[:, :top - 1].copy()                    # a valid ciphertext one level down
    good = wrap(raw)
    tail = sealio.write_ciphertext(raw, compress=False) + b"\0" * 8
    tail = tail[:8] + len(tail).to_bytes(8, "little") + tail[16:]
    return {
        "bytes after the ciphertext": wire.pack_ciphertext(tail, params, fingerprint),
        "residue >= prime": wrap(data(over)),
        "not NTT form": wrap(raw, ntt=(32, b"\0")),
        "correction factor 2": wrap(raw, corr=(32 + 1 + 8 * 4, struct.pack("<Q", 2))),
        "other scale": wrap(sealio.RawCiphertext(raw.parms_id, raw.scale * 2, raw.data)),
        "size 3": wrap(data(np.concatenate([raw.data, raw.data[:1]]))),
        "lower level": wrap(sealio.RawCiphertext(gpu.ctx.parms_ids[top - 1], raw.scale, lower)),
        "parms_id of another level": wrap(sealio.RawCiphertext(gpu.ctx.parms_ids[top - 1], raw.scale, raw.data)),
        "truncated": good[:-8],
        "other key set": wire.pack_ciphertext(wire.ciphertext_payload(good, params, fingerprint), params,
                                              "ab" * 32),
        "garbage in SEAL's frame": wire.pack_ciphertext(good[78:94] + b"\x17" * (len(good) - 94), params,
                                                        fingerprint),
    }
