"""Raw CKKS operations on Microsoft SEAL through ``tenseal.sealapi`` — hazardous materials.

Nothing here checks that a computation is meaningful: levels, scales and slot layouts are the
caller's business (``fhe.linalg``, ``fhe.attention`` do that). Safe recipes live outside ``hazmat``.

Conventions:
* a *level* is named by how many data primes a ciphertext still has (``ct.coeff_modulus_size()``);
  a fresh ciphertext has ``params.depth + 1`` of them, the last one has 1;
* plaintexts multiplied into a ciphertext that is rescaled right after are encoded at scale ``q_l``
  (the prime about to be dropped), so the ciphertext's scale comes back exactly (see ``mul_plain``);
* SEAL's C++ exceptions surface as ``RuntimeError``/``ValueError``; :func:`translate` maps them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import tenseal.sealapi as sa

from fhe import sealio
from fhe.errors import LevelError, ParameterError, WireError
from fhe.evaluator import ParamsQueries
from fhe.params import CKKSParams

Ciphertext = sa.Ciphertext
Plaintext = sa.Plaintext


@contextlib.contextmanager
def translate(what: str) -> Iterator[None]:
    """Turn SEAL/pybind11 exceptions raised inside the block into :class:`WireError`."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, MemoryError, OverflowError) as exc:
        raise WireError(f"{what}: {exc}") from exc


def build_context(params: CKKSParams) -> sa.SEALContext:
    """A SEAL CKKS context for ``params`` (128-bit security enforced by SEAL too)."""
    p = sa.EncryptionParameters(sa.SCHEME_TYPE.CKKS)
    p.set_poly_modulus_degree(params.poly_modulus_degree)
    p.set_coeff_modulus(sa.CoeffModulus.Create(params.poly_modulus_degree, list(params.coeff_mod_bit_sizes)))
    ctx = sa.SEALContext(p, True, sa.SEC_LEVEL_TYPE.TC128)
    if not ctx.parameters_set():
        raise ParameterError(f"SEAL rejects {params}: {ctx.parameters_error_message()}")
    return ctx


def _context_from_moduli(n: int, moduli: list) -> sa.SEALContext:
    p = sa.EncryptionParameters(sa.SCHEME_TYPE.CKKS)
    p.set_poly_modulus_degree(n)
    p.set_coeff_modulus(moduli)
    ctx = sa.SEALContext(p, True, sa.SEC_LEVEL_TYPE.TC128)
    if not ctx.parameters_set():
        raise ParameterError(f"SEAL rejects a key chain of {len(moduli)} primes: {ctx.parameters_error_message()}")
    return ctx


@dataclass(frozen=True)
class KeyContext:
    """A prime chain that stops at ``level`` (plus the special prime), and an evaluator on it."""

    level: int
    context: sa.SEALContext
    evaluator: sa.Evaluator

    @property
    def key_parms_id(self) -> list[int]:
        return list(self.context.key_parms_id())


def galois_elements(steps: Sequence[int], slots: int) -> list[int]:
    """Galois elements 3^k mod 2N for left-rotation steps k (what ``create_galois_keys`` takes)."""
    two_n = 4 * slots
    return sorted({pow(3, s % slots, two_n) for s in steps if s % slots})


@dataclass
class Kit(ParamsQueries):
    """SEAL objects shared by one context: encoder, evaluator, level table. No keys."""

    params: CKKSParams
    context: sa.SEALContext = field(init=False)
    encoder: sa.CKKSEncoder = field(init=False)
    evaluator: sa.Evaluator = field(init=False)
    parms_ids: dict[int, list[int]] = field(init=False)   # level (data primes) -> parms_id
    primes: list[int] = field(init=False)                 # data primes, q0 first
    _key_contexts: dict[int, KeyContext] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.context = build_context(self.params)
        self.encoder = sa.CKKSEncoder(self.context)
        self.evaluator = sa.Evaluator(self.context)
        self.parms_ids, data = {}, self.context.first_context_data()
        while data is not None:
            q = data.parms().coeff_modulus()
            self.parms_ids[len(q)] = data.parms_id()
            if len(q) == self.params.depth + 1:
                self.primes = [m.value() for m in q]
            data = data.next_context_data()

    def key_context(self, level: int) -> KeyContext:
        """The context whose prime chain stops at ``level`` (q_0..q_{level-1} and the special prime):
        keys made in it switch this kit's ciphertexts at levels <= ``level`` (same parms_id there).
        At the top level it is this kit's own context."""
        if not 1 <= level <= self.top:
            raise LevelError(f"no key level {level} (1..{self.top})")
        if level not in self._key_contexts:
            if level == self.top:
                ctx = self.context
            else:
                moduli = list(self.context.key_context_data().parms().coeff_modulus())
                ctx = _context_from_moduli(self.params.poly_modulus_degree, moduli[:level] + moduli[-1:])
            self._key_contexts[level] = KeyContext(level, ctx, self.evaluator if ctx is self.context
                                                   else sa.Evaluator(ctx))
        return self._key_contexts[level]

    def encode(self, values: np.ndarray, level: int, scale: float) -> sa.Plaintext:
        """Real vector (<= slots, zero-padded) -> plaintext at ``level`` and ``scale``."""
        v = np.zeros(self.slots)
        v[: len(values)] = values
        pt = sa.Plaintext()
        self.encoder.encode(v.tolist(), self.parms_ids[level], scale, pt)
        return pt

    def decode(self, pt: sa.Plaintext) -> np.ndarray:
        return np.asarray(self.encoder.decode_double(pt))

    def prime(self, level: int) -> float:
        """The prime a rescale at ``level`` drops."""
        return float(self.primes[level - 1])

    # --- evaluation -----------------------------------------------------------------------
    def rotate(self, ct: sa.Ciphertext, step: int, gk: sa.GaloisKeys) -> sa.Ciphertext:
        """Left rotation by ``step`` slots (needs the Galois key of that step)."""
        if step % self.slots == 0:
            return ct
        out = sa.Ciphertext()
        self.evaluator.rotate_vector(ct, step % self.slots, gk, out)
        return out

    def mul_plain(self, ct: sa.Ciphertext, pt: sa.Plaintext) -> sa.Ciphertext:
        out = sa.Ciphertext()
        self.evaluator.multiply_plain(ct, pt, out)
        return out

    def dot_plain(self, pairs: Sequence[tuple[sa.Ciphertext, sa.Plaintext]]) -> sa.Ciphertext:
        """sum_i ct_i * pt_i, accumulated in place through one scratch ciphertext (a product per term
        into a new ciphertext, then add_many, allocates every term: ~20% slower for the block's maps)."""
        (ct0, pt0), *rest = pairs
        acc = self.mul_plain(ct0, pt0)
        tmp = sa.Ciphertext()
        for ct, pt in rest:
            self.evaluator.multiply_plain(ct, pt, tmp)
            self.evaluator.add_inplace(acc, tmp)
        return acc

    def mul(self, a: sa.Ciphertext, b: sa.Ciphertext) -> sa.Ciphertext:
        """Ciphertext product (size 3: relinearize before rotating)."""
        out = sa.Ciphertext()
        self.evaluator.multiply(a, b, out)
        return out

    def relin_rescale(self, ct: sa.Ciphertext, rk: sa.RelinKeys | None) -> sa.Ciphertext:
        if rk is not None and ct.size() > 2:
            self.evaluator.relinearize_inplace(ct, rk)
        out = sa.Ciphertext()
        self.evaluator.rescale_to_next(ct, out)
        return out

    def add(self, a: sa.Ciphertext, b: sa.Ciphertext) -> sa.Ciphertext:
        out = sa.Ciphertext()
        self.evaluator.add(a, b, out)
        return out

    def add_many(self, cts: Sequence[sa.Ciphertext]) -> sa.Ciphertext:
        out = sa.Ciphertext()
        self.evaluator.add_many(list(cts), out)
        return out

    def add_plain_values(self, ct: sa.Ciphertext, values: np.ndarray) -> sa.Ciphertext:
        """ct + values (encoded at the ciphertext's own level and scale)."""
        pt = self.encode(values, ct.coeff_modulus_size(), ct.scale)
        out = sa.Ciphertext()
        self.evaluator.add_plain(ct, pt, out)
        return out

    def drop_to(self, ct: sa.Ciphertext, level: int) -> sa.Ciphertext:
        """Modulus-switch (no rescale) down to ``level``."""
        have = ct.coeff_modulus_size()
        if have < level:
            raise LevelError(f"ciphertext at level {have} cannot go up to {level}")
        if have == level:
            return ct
        out = sa.Ciphertext()
        self.evaluator.mod_switch_to(ct, self.parms_ids[level], out)
        return out


@dataclass
class SecretKeys:
    """Everything the client holds: secret key plus the public material generated from it.

    ``blobs`` are the public objects as uploaded: relin and Galois keys in SEAL's seeded form (half the
    bytes); the in-memory ``relin``/``galois`` objects are those blobs loaded back.
    """

    secret: sa.SecretKey
    public: sa.PublicKey
    relin: sa.RelinKeys | None      # None for a level-aware set (its keys are blobs only)
    galois: sa.GaloisKeys | None
    blobs: dict[str, bytes]


def generate_keys(kit: Kit, rotation_steps: Sequence[int]) -> SecretKeys:
    """Fresh key set with Galois keys for exactly ``rotation_steps``."""
    kg = sa.KeyGenerator(kit.context)
    pk = sa.PublicKey()
    kg.create_public_key(pk)
    blobs = {"public_key": to_bytes(pk), "relin_keys": to_bytes(kg.create_relin_keys()),
             "galois_keys": to_bytes(kg.create_galois_keys(galois_elements(rotation_steps, kit.slots)))}
    rk = from_bytes("relin_keys", kit, blobs["relin_keys"])
    gk = from_bytes("galois_keys", kit, blobs["galois_keys"])
    return SecretKeys(kg.secret_key(), pk, rk, gk, blobs)


def generate_secret(kit: Kit) -> SecretKeys:
    """A fresh secret key and its public key only (the evaluation keys come per level:
    :func:`generate_level_keys`)."""
    kg = sa.KeyGenerator(kit.context)
    pk = sa.PublicKey()
    kg.create_public_key(pk)
    return SecretKeys(kg.secret_key(), pk, None, None, {"public_key": to_bytes(pk)})


def generate_level_keys(kit: Kit, sk: sa.SecretKey, galois: Mapping[int, Sequence[int]],
                        relin_level: int) -> dict[int, tuple[bytes | None, bytes | None]]:
    """Seeded relin/Galois key blobs made at their levels: level -> (relin blob or None, Galois blob or None).

    ``galois`` maps a level to the rotation steps whose key is made there. Each level's keys come from
    ``sk`` restricted to that level's chain (:func:`restrict_secret`): the same secret, so they switch
    the main context's ciphertexts.
    """
    out: dict[int, tuple[bytes | None, bytes | None]] = {}
    for level in sorted({*galois, relin_level}, reverse=True):
        kc = kit.key_context(level)
        kg = sa.KeyGenerator(kc.context, restrict_secret(kit, sk, level))
        rk = to_bytes(kg.create_relin_keys()) if level == relin_level else None
        steps = galois.get(level, ())
        gk = to_bytes(kg.create_galois_keys(galois_elements(steps, kit.slots))) if steps else None
        out[level] = (rk, gk)
    return out


def restrict_secret(kit: Kit, sk: sa.SecretKey, level: int) -> sa.SecretKey:
    """``sk`` on the chain of :meth:`Kit.key_context` ``(level)``: its RNS rows for q_0..q_{level-1} and the
    special prime (the secret is one small polynomial; each row is its NTT mod one prime)."""
    kc = kit.key_context(level)
    if level == kit.top:
        return sk
    n, pt = kit.params.poly_modulus_degree, sk.data()
    rows = np.frombuffer(_plain_words(pt), dtype="<u8").reshape(-1, n)
    keep = np.concatenate([rows[:level], rows[-1:]]).astype("<u8")
    members = (struct.pack("<4Q", *kc.key_parms_id) + struct.pack("<Qd", keep.size, 1.0)
               + _seal_object(struct.pack("<Q", keep.size) + keep.tobytes()))
    return from_bytes_in("secret_key", kc.context, _seal_object(members))


def _plain_words(pt: sa.Plaintext) -> bytes:
    """A plaintext's coefficients as little-endian u64 (sealapi gives no buffer, only per-index reads)."""
    return np.fromiter((pt[i] for i in range(pt.coeff_count())), dtype="<u8", count=pt.coeff_count()).tobytes()


#: SEAL's serialization header: magic, header size, version major/minor, compression, reserved, size.
_SEAL_HEAD = struct.Struct("<HBBBBHQ")


@functools.cache
def _seal_version() -> tuple[int, int]:
    """(major, minor) this SEAL writes (its loader checks them)."""
    return _SEAL_HEAD.unpack_from(to_bytes(sa.Plaintext()))[2:4]


def _seal_object(members: bytes) -> bytes:
    """One uncompressed SEAL serialization of ``members`` (what SEAL's ``load`` reads, compr mode none)."""
    return _SEAL_HEAD.pack(0xA15E, _SEAL_HEAD.size, *_seal_version(), 0, 0,
                           _SEAL_HEAD.size + len(members)) + members


def encrypt(kit: Kit, pk: sa.PublicKey, values: np.ndarray) -> sa.Ciphertext:
    """Public-key encryption of a real vector at the top level and the default scale."""
    ct = sa.Ciphertext()
    sa.Encryptor(kit.context, pk).encrypt(kit.encode(values, kit.top, kit.scale), ct)
    return ct


def encrypt_symmetric(kit: Kit, sk: sa.SecretKey, values: np.ndarray) -> sa.Ciphertext:
    """Secret-key encryption (the client holds sk): far less fresh noise than public-key encryption."""
    ct = sa.Ciphertext()
    sa.Encryptor(kit.context, sk).encrypt_symmetric(kit.encode(values, kit.top, kit.scale), ct)
    return ct


def encrypt_zero_symmetric(kit: Kit, sk: sa.SecretKey) -> sa.Ciphertext:
    """A fresh secret-key encryption of zero at the top level (scale 1: not yet carrying a message).

    SEAL's :func:`encrypt_symmetric` is exactly this plus the encoded plaintext added to c0 (its scale then the
    plaintext's): :func:`add_message` finishes it, so the randomness can be drawn ahead of the message."""
    ct = sa.Ciphertext()
    sa.Encryptor(kit.context, sk).encrypt_zero_symmetric(kit.parms_ids[kit.top], ct)
    return ct


def add_message(kit: Kit, zero: sa.Ciphertext, values: np.ndarray) -> sa.Ciphertext:
    """``zero`` (from :func:`encrypt_zero_symmetric`, never used before) turned into the encryption of ``values``
    at the top level and default scale, in place: what :func:`encrypt_symmetric` computes after its own zero.

    Raises:
        ValueError: ``zero`` carries a message already (its scale is no longer 1) or is not a fresh top-level
            ciphertext: an encryption's randomness serves one message, never two.
    """
    if zero.scale != 1.0 or zero.size() != 2 or zero.coeff_modulus_size() != kit.top or not zero.is_ntt_form():
        raise ValueError("not an unused encryption of zero at the top level")
    pt = kit.encode(values, kit.top, kit.scale)
    zero.scale = pt.scale
    kit.evaluator.add_plain_inplace(zero, pt)
    return zero


def encrypt_zero_symmetric_seeded(kit: Kit, sk: sa.SecretKey):
    """:func:`encrypt_zero_symmetric` in SEAL's seeded form, parsed: a ``fhe.sealio.SeededCiphertext``
    (c0 and the seed of c1; scale 1) for :func:`add_message_seeded`."""
    n = kit.params.poly_modulus_degree
    data = to_bytes(sa.Encryptor(kit.context, sk).encrypt_zero_symmetric(kit.parms_ids[kit.top]))
    zero = sealio.read_fresh_ct_members(sealio.open_object(data, 2 * kit.top * n * 8 + 4096), n)
    if not isinstance(zero, sealio.SeededCiphertext):
        raise WireError("SEAL saved an encryption of zero without its seed")
    return zero


def add_message_seeded(kit: Kit, zero, values: np.ndarray) -> bytes:
    """The seeded serialization of the encryption of ``values`` made on ``zero`` (from
    :func:`encrypt_zero_symmetric_seeded`, never used before; consumed): SEAL's seeded symmetric encryption is its
    seeded zero with the encoded message added to c0 and the plaintext's scale, and SEAL's save then writes c0 and
    the seed, which is what is written here (the bytes :func:`encrypt_symmetric_seeded` would give for that zero).

    Raises:
        ValueError: ``zero`` carries a message already or is not a fresh top-level seeded ciphertext.
    """
    n = kit.params.poly_modulus_degree
    if (zero.scale != 1.0 or zero.c0 is None or zero.c0.shape != (kit.top, n)
            or zero.parms_id != struct.pack("<4Q", *kit.parms_ids[kit.top])):
        raise ValueError("not an unused seeded encryption of zero at the top level")
    pt = kit.encode(values, kit.top, kit.scale)
    # SEAL has no bulk accessor for a plaintext's residues: its own save, read back (numpy)
    _, _, m = sealio.read_plaintext(to_bytes(pt), n)
    c0 = zero.c0 + m                                          # residues < q < 2^61: no overflow
    # mod q: c0 - q wraps around (to the larger value) where c0 < q
    np.minimum(c0, c0 - np.asarray(kit.primes, dtype=np.uint64).reshape(-1, 1), out=c0)
    out = sealio.write_seeded_ciphertext(sealio.SeededCiphertext(zero.parms_id, pt.scale, c0, zero.prng_type,
                                                                 zero.seed))
    zero.scale, zero.c0 = pt.scale, None                      # an encryption's randomness serves one message
    return out


def encrypt_symmetric_seeded(kit: Kit, sk: sa.SecretKey, values: np.ndarray) -> bytes:
    """Serialized secret-key encryption with the random half replaced by its seed (about half the bytes)."""
    ser = sa.Encryptor(kit.context, sk).encrypt_symmetric(kit.encode(values, kit.top, kit.scale))
    return to_bytes(ser)


def decrypt(kit: Kit, sk: sa.SecretKey, ct: sa.Ciphertext, decryptor: sa.Decryptor | None = None) -> np.ndarray:
    """Decrypt and decode ``ct`` (``decryptor``: one made for ``sk`` in ``kit.context`` before, reused: making one
    copies the secret key's residues, ~0.7 ms at N = 32768, more than the decryption of a level-1 answer)."""
    pt = sa.Plaintext()
    (decryptor or sa.Decryptor(kit.context, sk)).decrypt(ct, pt)
    return kit.decode(pt)


# --- serialization (sealapi only saves to / loads from paths) ------------------------------------
_LOADABLE = {"ciphertext": sa.Ciphertext, "public_key": sa.PublicKey, "relin_keys": sa.RelinKeys,
             "galois_keys": sa.GaloisKeys, "secret_key": sa.SecretKey}


@contextlib.contextmanager
def _memory_path() -> Iterator[tuple[int, str]]:
    """An anonymous in-memory file (``memfd``) and a path SEAL can open it by.

    sealapi saves to and loads from paths only. A named temporary file would put a client's secret key
    (or a tenant's ciphertext) on disk, where a crash between write and unlink leaves it; a memfd has no
    name in any filesystem, lives in RAM and vanishes with its last descriptor, crash or not.
    """
    if not hasattr(os, "memfd_create"):
        raise OSError("in-memory SEAL serialization needs memfd_create (Linux)")
    fd = os.memfd_create("cipherlm-seal", getattr(os, "MFD_CLOEXEC", 0))
    try:
        yield fd, f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def to_bytes(obj) -> bytes:
    """SEAL's own serialization (zstd-compressed when SEAL was built with it), through memory only."""
    with _memory_path() as (fd, path):
        with translate("serialize"):
            obj.save(path)
        return _read_all(fd)


def from_bytes(kind: str, kit: Kit, data: bytes):
    """Load a SEAL object of ``kind`` for ``kit.context``; SEAL validates it against the context.

    The bytes go through an in-memory file only (never a file on disk: see :func:`_memory_path`).
    """
    return from_bytes_in(kind, kit.context, data)


def from_bytes_in(kind: str, context: sa.SEALContext, data: bytes):
    """:func:`from_bytes` for any context (a key level's chain, :meth:`Kit.key_context`)."""
    obj = _LOADABLE[kind]()
    with _memory_path() as (fd, path):
        _write_all(fd, data)
        with translate(f"deserialize {kind}"):
            obj.load(context, path)
            if not sa.is_valid_for(obj, context):
                raise ValueError("not valid for this context")
    return obj
