"""Level-aware evaluation keys (issue 15, item 3): each Galois key and the relinearization key made in a
context whose prime chain stops at the level where the block uses it.

What is checked here, at small parameters: the block's per-step level map is what the block really does
(every rotation and relinearization traced on the symbolic evaluator); a key made at level L switches
ciphertexts at <= L and gives bit-identical results to the full key when it is the full key's
restriction; the upload carries exactly the plan's levels (a key at another level, an old upload
without levels, a secret key: refused); level-aware keys are smaller. The shipped N = 32768 sizes are
in tests/fhe/test_attention.py (whose SmolLM2 block test runs on that key set: one key generation for
both) and in docs/benchmarks.md.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from fhe.attention import BlockClient, EncryptedAttentionLayer, required_key_levels, required_rotation_steps
from fhe.backends import evaluator_for
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.backends.symbolic import SymbolicClient, SymbolicEvaluator
from fhe.envelope import pack_key_upload, parse_key_upload
from fhe.errors import KeyMismatchError, KeyRefusedError, LevelError, ParameterError, SecretKeyRefusedError
from fhe.fingerprint import blob_order, key_fingerprint
from fhe.params import CKKSParams, KeyLevels, ckks_params_for
from tests.fhe.test_attention import calibrated_plan, layer_input
from tests.fhe.test_symbolic import wide_model

P = CKKSParams(8192, (50, 30, 30, 30, 50), 30)        # top level 4: keys at 4, 3, 2, 1 are all distinct
LEVELS = KeyLevels.build(P, {1: 4, 2: 2, -1: 3, 5: 1}, 3)


# --- the block's level map is what the block does ---------------------------------------------------
class TracingEvaluator(SymbolicEvaluator):
    """The symbolic evaluator, recording the level of every key-switching operation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rotations: dict[int, set[int]] = {}
        self.relins: set[int] = set()

    def rotate(self, ct, step, keys):
        if step % self.slots:
            self.rotations.setdefault(step % self.slots, set()).add(ct.level)
        return super().rotate(ct, step, keys)

    def relinearize(self, ct, keys):
        self.relins.add(ct.level)
        return super().relinearize(ct, keys)


@pytest.mark.parametrize("kind,tokens", [("sqexp", 50), ("2quad", 3)])
def test_the_level_map_is_where_the_block_switches_keys(kind, tokens):
    """Every rotation by a step happens at or below its key's level, and the highest use of each step is
    exactly its key's level (the map is tight); the relinearization key serves every product."""
    model = wide_model()
    ids = torch.randint(0, 61, (tokens,), generator=torch.Generator().manual_seed(1))
    x = layer_input(model, 1, ids)
    plan = calibrated_plan(model, 1, x, kind)
    cfg, sq = model.config, plan.approx.squarings
    params = ckks_params_for(kind, sq)
    ev = TracingEvaluator(params)
    block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64, evaluator=ev)
    levels = block.key_levels
    assert levels == required_key_levels(cfg, params, kind, sq)          # public: the client computes it
    assert set(levels.steps) == set(required_rotation_steps(cfg, params, kind, sq))
    client = SymbolicClient(params, levels.steps)
    bc = BlockClient.for_model(client, cfg, kind, sq)
    cache = block.new_cache()
    block.prefill(cache, bc.encrypt_input(x), 0, client.server_keys())
    # the packed prefill is part of the block too: its uses are in the map (+1 at the top, W and -Hq one
    # level below; a short chunk makes every one of them)
    block.prefill_packed(block.new_cache(), bc.encrypt_packed(x[:3]), 0, 3, client.server_keys())
    used = {s: max(lv) for s, lv in ev.rotations.items()}
    assert used == dict(levels.galois)
    assert max(ev.relins) == levels.relin
    assert len(levels.levels()) >= 3 and levels.relin < params.depth + 1   # keys below the top exist


def test_key_levels_merge_and_validate():
    a = KeyLevels.build(P, {1: 2, 8193: 4, 0: 3}, 2)                      # 8193 = 1 mod S: highest wins
    assert a.galois == ((1, 4),) and a.relin == 2
    b = KeyLevels.build(P, {1: 3, 2: 1}, 3)
    assert a.merge(b) == KeyLevels(((1, 4), (2, 1)), 3)
    assert KeyLevels.full(P, (1, 2)) == KeyLevels(((1, 4), (2, 4)), 4)
    with pytest.raises(ParameterError):
        KeyLevels.build(P, {1: 5}, 2)
    with pytest.raises(ParameterError):
        KeyLevels.build(P, {1: 2}, 0)


# --- SEAL: a key at level L works on the main context's ciphertexts at <= L ------------------------
def _members(blob: bytes) -> bytes:
    """The members of one SEAL serialization (its compression undone)."""
    _, _, _, _, mode, _, _ = seal._SEAL_HEAD.unpack_from(blob)
    body = blob[seal._SEAL_HEAD.size:]
    if mode == 0:
        return body
    if mode == 1:
        return zlib.decompress(body)
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdDecompressor().decompressobj().decompress(body)


def restrict_kswitch_keys(kit: seal.Kit, keys, level: int, kind: str):
    """A full (non-seeded) relin/Galois key restricted to the chain of ``level``: the first ``level``
    decomposition parts, each with its RNS rows for q_0..q_{level-1} and the special prime. Exactly the
    numbers SEAL's key switching reads at <= ``level``, so results must be bit-identical."""
    kc, n, k_all = kit.key_context(level), kit.params.poly_modulus_degree, kit.top + 1
    raw, pid = _members(seal.to_bytes(keys)), struct.pack("<4Q", *kc.key_parms_id)
    (dim1,), off, out = struct.unpack_from("<Q", raw, 32), 40, [pid, struct.pack("<Q", 0)]
    out[1] = struct.pack("<Q", dim1)
    for _ in range(dim1):
        (dim2,) = struct.unpack_from("<Q", raw, off)
        off += 8
        out.append(struct.pack("<Q", min(dim2, level)))
        for j in range(dim2):
            size = seal._SEAL_HEAD.unpack_from(raw, off)[-1]
            ct = _members(raw[off:off + size])
            off += size
            if j < level:
                out.append(seal._seal_object(_restrict_ciphertext(ct, pid, n, k_all, level)))
    return seal.from_bytes_in(kind, kc.context, seal._seal_object(b"".join(out)))


def _restrict_ciphertext(ct: bytes, pid: bytes, n: int, k_all: int, level: int) -> bytes:
    is_ntt, size, degree, cms, scale, corr = struct.unpack_from("<BQQQdQ", ct, 32)
    assert (degree, cms) == (n, k_all)
    arr = _members(ct[73:])
    data = np.frombuffer(arr, "<u8", offset=8).reshape(size, k_all, n)
    keep = np.concatenate([data[:, :level], data[:, -1:]], axis=1)
    head = pid + struct.pack("<BQQQdQ", is_ntt, size, degree, level + 1, scale, corr)
    return head + seal._seal_object(struct.pack("<Q", keep.size) + keep.tobytes())


@pytest.fixture(scope="module")
def full():
    """One key pair, with full keys for the steps of LEVELS (the reference)."""
    kit = seal.Kit(P)
    keys = seal.generate_keys(kit, LEVELS.steps)
    return kit, keys


def test_restricted_keys_are_bit_identical_to_full_keys(full):
    kit, keys = full
    x = np.linspace(-1, 1, kit.slots)
    ct = seal.encrypt_symmetric(kit, keys.secret, x)
    for level in range(1, kit.top + 1):
        gk = restrict_kswitch_keys(kit, keys.galois, level, "galois_keys")
        rk = restrict_kswitch_keys(kit, keys.relin, level, "relin_keys")
        kc = kit.key_context(level)
        for at in range(1, level + 1):
            c = kit.drop_to(ct, at)
            a, b = seal.sa.Ciphertext(), seal.sa.Ciphertext()
            kc.evaluator.rotate_vector(c, 1, gk, a)
            kit.evaluator.rotate_vector(c, 1, keys.galois, b)
            assert seal.to_bytes(a) == seal.to_bytes(b)
            c.scale = 2.0 ** 20                  # relabel: the square's scale must fit even q_0 alone
            sq, sq2 = kit.mul(c, c), kit.mul(c, c)
            kc.evaluator.relinearize_inplace(sq, rk)
            kit.evaluator.relinearize_inplace(sq2, keys.relin)
            assert seal.to_bytes(sq) == seal.to_bytes(sq2)


def test_level_keys_switch_at_their_level_and_below_only():
    client = CKKSClient(P, LEVELS.steps, levels=LEVELS)
    keys = client.server_keys()
    ev = evaluator_for(P)
    x = np.random.default_rng(0).uniform(-1, 1, P.slots)    # a wrong rotation is off by O(1)
    ct = client.encrypt(x)
    for step, key_level in LEVELS.galois:
        for at in range(1, kit_top(P) + 1):
            c = ev.mod_switch(ct, at)
            if at > key_level:
                with pytest.raises(LevelError):
                    ev.rotate(c, step, keys)
                continue
            out = client.decrypt(ev.rotate(c, step, keys))
            assert np.abs(out - np.roll(x, -step)).max() < 1e-2   # CKKS noise at a 2^30 scale: ~1e-3
    c = ev.mod_switch(ct, LEVELS.relin)
    sq = ev.rescale(ev.relinearize(ev.square(c), keys))
    assert ev.size(sq) == 2 and np.abs(client.decrypt(sq) - x * x).max() < 1e-2
    with pytest.raises(LevelError):
        ev.relinearize(ev.square(ct), keys)                   # top level: above the relin key's level
    with pytest.raises(KeyMismatchError):
        ev.rotate(ct, 7, keys)


def kit_top(params: CKKSParams) -> int:
    return params.depth + 1


# --- the upload ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def leveled():
    return CKKSClient(P, LEVELS.steps, levels=LEVELS)


def test_upload_names_sizes_and_fingerprint(leveled, full):
    upload = wire.dump_public_keys(leveled)
    assert list(blob_order(upload)) == ["public_key", "relin_keys@3", "galois_keys@4", "galois_keys@3",
                                        "galois_keys@2", "galois_keys@1"]
    assert set(upload) == set(wire.expected_blobs(LEVELS))
    body = pack_key_upload(upload)
    assert parse_key_upload(body, 1 << 30) == upload                       # framing keeps every level
    keys = wire.load_server_keys(upload, P, LEVELS)
    assert keys.fingerprint == leveled.fingerprint == key_fingerprint(P, leveled.public_blobs)
    parsed = wire.parse_server_keys(upload, P, LEVELS)
    again = wire.load_server_keys(parsed.canonical, P, LEVELS, fingerprint=keys.fingerprint)
    assert again.levels == LEVELS and set(parsed.canonical) == set(upload)
    # smaller than the same steps all at the top level (seeded both)
    old = CKKSClient(P, LEVELS.steps)
    assert sum(map(len, leveled.public_blobs.values())) < 0.8 * sum(map(len, old.public_blobs.values()))
    one_step = {lv: len(seal.generate_level_keys(full[0], full[1].secret, {lv: (1,)}, 1)[lv][1])
                for lv in (1, 2, 3, 4)}
    assert one_step[1] < one_step[2] < one_step[3] < one_step[4]


def test_an_upload_outside_the_plan_levels_is_refused(leveled):
    upload = wire.dump_public_keys(leveled)
    other = KeyLevels.build(P, {1: 4, 2: 3, -1: 3, 5: 1}, 3)               # step 2 at 3, not 2
    with pytest.raises((KeyRefusedError, KeyMismatchError)):
        wire.load_server_keys(upload, P, other)
    moved = {**upload, "galois_keys@2": upload["galois_keys@1"]}            # a key made at another level
    moved.pop("galois_keys@1")
    with pytest.raises(KeyRefusedError):
        wire.load_server_keys(moved, P, KeyLevels.build(P, {1: 4, 2: 2, -1: 3, 5: 2}, 3))
    extra = {**upload, "galois_keys@9": upload["galois_keys@1"]}            # a level the plan does not use
    with pytest.raises(KeyRefusedError, match="levels the plan does not use"):
        wire.load_server_keys(extra, P, LEVELS)
    relin_at_top = {**upload, "relin_keys@4": upload["relin_keys@3"]}
    relin_at_top.pop("relin_keys@3")
    with pytest.raises(KeyRefusedError):
        wire.load_server_keys(relin_at_top, P, LEVELS)


def test_old_uploads_without_levels_are_refused_by_name(leveled):
    old = wire.dump_public_keys(CKKSClient(P, LEVELS.steps))
    with pytest.raises(KeyMismatchError, match="without level-aware keys.*galois_keys@4"):
        wire.load_server_keys(old, P, LEVELS)
    with pytest.raises(KeyMismatchError, match="level-aware"):
        wire.load_server_keys(wire.dump_public_keys(leveled), P, LEVELS.steps)


def test_a_secret_key_is_refused_under_any_level_name(leveled):
    upload = wire.dump_public_keys(leveled)
    secret = wire._pack("secret_key", P, None, leveled.unsafe_export_secret())
    for name in ("secret_key", "galois_keys@2", "relin_keys@3"):
        with pytest.raises(SecretKeyRefusedError):
            wire.load_server_keys({**upload, name: secret}, P, LEVELS)


def test_restored_client_keeps_the_level_layout(leveled):
    again = CKKSClient.restore(P, LEVELS.steps, leveled.unsafe_export_secret(), dict(leveled.public_blobs),
                               levels=LEVELS)
    assert again.fingerprint == leveled.fingerprint
    keys = wire.load_server_keys(wire.dump_public_keys(again), P, LEVELS)
    x = np.arange(8.0)
    out = again.decrypt(evaluator_for(P).rotate(again.encrypt(x), 1, keys))
    assert np.allclose(out[:7], x[1:], atol=1e-2)


# --- the whole block: level keys give the full keys' exact bytes (slow: N = 16384) ----------------
@pytest.mark.slow
def test_block_outputs_are_bit_identical_with_level_keys():
    """2Quad on the tiny GQA model: prefill + decode with the full keys and with their restrictions to
    the block's key levels give byte-identical output ciphertexts (~45 s on the shared 2-core box). Three
    positions (four until session 22): position 0's single-key step and two that attend to earlier keys run
    every operation of the block; a fourth repeats them on a longer cache."""
    from fhe.backends.seal.keys import ServerKeys
    from tests.fhe.test_attention import tiny_model

    model = tiny_model(bias=True)
    x = layer_input(model, 1, torch.tensor([3, 14, 15]))
    plan = calibrated_plan(model, 1, x, "2quad")
    params = ckks_params_for("2quad", plan.approx.squarings)
    block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64)
    levels = block.key_levels
    client = CKKSClient(params, levels.steps)
    full_keys = client.server_keys()
    kit, gk = client.kit, client.keys.galois
    level_keys = ServerKeys(kit, client.keys.public, restrict_kswitch_keys(kit, client.keys.relin, levels.relin,
                                                                           "relin_keys"),
                            {lv: restrict_kswitch_keys(kit, gk, lv, "galois_keys") for lv in levels.levels()},
                            levels, client.fingerprint, leveled=True)
    assert min(levels.levels()) < kit.top
    cts = BlockClient.for_model(client, model.config, "2quad", plan.approx.squarings).encrypt_input(x)
    outs = {}
    for name, keys in (("full", full_keys), ("levels", level_keys)):
        cache = block.new_cache()
        outs[name] = [seal.to_bytes(c) for c in block.prefill(cache, cts, 0, keys)]
    assert outs["full"] == outs["levels"]
