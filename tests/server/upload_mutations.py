"""Malformed full (unseeded) uploads for the gpu backend's direct parse: one per way SEAL's load or the worker's
freshness check refuses a ciphertext (the offload plan's linear steps and the attention steps both read them)."""

from __future__ import annotations

import numpy as np


def full_upload_mutations(gpu, fingerprint: str, blob: bytes) -> dict[str, bytes]:
    """Full uploads of ``blob`` (a good one for ``gpu``'s parameters and key set ``fingerprint``) that are each
    wrong in one way SEAL's load or the freshness check refuses."""
    import struct

    from fhe import sealio
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


def seeded_upload_mutations(gpu, fingerprint: str, blob: bytes) -> dict[str, bytes]:
    """Seeded uploads of ``blob`` (a good seeded one for ``gpu``'s parameters and key set ``fingerprint``) that are
    each wrong in one way SEAL's load or the freshness check refuses (a Shake256 seed is not among them: SEAL
    takes it, expanding c1 with its other PRNG)."""
    import dataclasses
    import struct

    from fhe import sealio
    from fhe.backends.seal import wire

    params, n, top = gpu.params, gpu.params.poly_modulus_degree, gpu.top
    good = sealio.read_fresh_ct_members(sealio.open_object(wire.ciphertext_payload(blob, params, fingerprint),
                                                           1 << 30), n)
    assert isinstance(good, sealio.SeededCiphertext)

    def wrap(payload: bytes) -> bytes:
        return wire.pack_ciphertext(payload, params, fingerprint)

    def raw(ct=good) -> bytes:
        return sealio.write_seeded_ciphertext(ct, compress=False)

    def patched(off: int, value: bytes) -> bytes:
        payload = bytearray(raw())
        payload[off:off + len(value)] = value
        return wrap(bytes(payload))

    def framed(body: bytes) -> bytes:
        return body[:8] + len(body).to_bytes(8, "little") + body[16:]

    over = good.c0.copy()
    over[0, 7] = gpu.ctx.primes[0]                                   # a c0 residue equal to its prime
    members = 16                                                     # the first member after SEAL's header
    info = len(raw()) - 81                                           # the seed's frame
    return {
        "prng type 0": patched(info + 16, b"\0"),
        "prng type 3": patched(info + 16, b"\3"),
        "truncated seed": wrap(framed(raw()[:-8])),
        "no seed": wrap(framed(raw()[:info])),
        "seed frame of another size": patched(info + 8, struct.pack("<Q", 80)),
        "bytes after the seed": wrap(framed(raw() + b"\0" * 8)),
        "c0 residue >= prime": wrap(raw(dataclasses.replace(good, c0=over))),
        "not NTT form": patched(members + 32, b"\0"),
        "correction factor 2": patched(members + 32 + 1 + 8 * 4, struct.pack("<Q", 2)),
        "other scale": wrap(raw(dataclasses.replace(good, scale=good.scale * 2))),
        "lower level": wrap(raw(dataclasses.replace(good, parms_id=gpu.ctx.parms_ids[top - 1],
                                                    c0=good.c0[:top - 1].copy()))),
        "parms_id of another level": wrap(raw(dataclasses.replace(good, parms_id=gpu.ctx.parms_ids[top - 1]))),
        "size 3 with half the data": patched(members + 33, struct.pack("<Q", 3)),
    }
