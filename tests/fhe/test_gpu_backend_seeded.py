"""The gpu backend expands seeded uploads itself (issue 16, session 22): SEAL's Blake2xb stream
(:mod:`fhe.backends.gpu.blake2xb`, the Triton kernel under Triton's interpreter) and ``sample_poly_uniform``
(:mod:`fhe.backends.gpu.uniform`) give the c1 SEAL's own load expands from the same seeded bytes, residue for
residue, at a small N and at the shipped one; a seed of another PRNG is left to SEAL.

The oracles are SEAL's: ``tenseal.sealapi.Blake2xbPRNG`` (one u32 per call: a few buffers of stream) and SEAL's load
of the seeded ciphertext. On the GPU: tests/fhe/test_gpu_backend_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tenseal.sealapi as sa
import torch

from fhe import sealio
from fhe.backends.gpu import GpuEvaluator, blake2xb, uniform
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import CKKSParams, ckks_params_for

SMALL = CKKSParams(poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 40, 40, 60), scale_bits=40)


def _seed(k: int) -> list[int]:
    rng = np.random.default_rng(k)
    return [int(w) for w in rng.integers(0, 1 << 64, 8, dtype=np.uint64)]


@pytest.mark.parametrize("k", [0, 1])
def test_the_stream_is_seals_blake2xb_prng(k):
    seed = _seed(k)
    prng = sa.Blake2xbPRNG(seed)
    refills = 3
    want = np.array([prng.generate() for _ in range(refills * 1024)], dtype=np.uint32).view(np.uint64)
    got = blake2xb.stream_words(b"".join(w.to_bytes(8, "little") for w in seed), 0, refills, "cpu")
    assert np.array_equal(got.numpy().view(np.uint64), want)
    later = blake2xb.stream_words(b"".join(w.to_bytes(8, "little") for w in seed), 2, 1, "cpu")
    assert torch.equal(later, got[2 * 512:])                        # refill r alone = its place in the stream


@pytest.mark.skipif(int(np.__version__.split(".")[0]) >= 2,
                    reason="Triton 3.6's interpreter cannot build ~x on uint64 under numpy 2 (the device image); "
                           "CI's numpy < 2 runs it, and on CUDA the compiled kernel is checked below")
def test_the_triton_kernel_is_the_torch_reference_under_the_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from fhe.backends.gpu import blake2xb as B
        from fhe.backends.gpu import blake2xb_triton as K
        for seed, first, count in ((bytes(range(64)), 0, 1), (bytes(64), 7, 3)):
            roots = torch.from_numpy(B.refill_roots(seed, first, count).view("int64").copy())
            assert torch.equal(K.xof_blocks(roots), B.xof_blocks_torch(roots)), (first, count)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _expanded_both_ways(client: CKKSClient, ev: GpuEvaluator, values: np.ndarray):
    """(SEAL's load of the seeded bytes, as residues [2, L, N]; the seeded members; our device ciphertext)."""
    n = client.params.poly_modulus_degree
    payload = client.encrypt_bytes(values)
    full = sealio.read_ciphertext(seal.to_bytes(seal.from_bytes("ciphertext", client.kit, payload)), n, ev.top)
    members = sealio.read_fresh_ct_members(sealio.open_object(payload, 1 << 30), n)
    return full, members, ev.deserialize_fresh(payload)


def _rejections(members: sealio.SeededCiphertext, primes: list[int]) -> int:
    """How many bulk words SEAL redrew for this ciphertext (so that the test knows it tried the replacement)."""
    lev, n = members.c0.shape
    words = blake2xb.stream_words(members.seed, 0, -(-lev * n // 512), "cpu").numpy().view(np.uint64)[:lev * n]
    bounds = np.array([uniform.max_multiple(q) for q in primes], dtype=np.uint64).reshape(-1, 1)
    return int((words.reshape(lev, n) >= bounds).sum())


@pytest.mark.parametrize("params", [SMALL, ckks_params_for("sqexp", 6)], ids=["N8192", "shipped-N32768"])
def test_the_device_expansion_is_seals_load_of_the_same_seeded_bytes(params):
    client = CKKSClient(params, ())
    ev = GpuEvaluator(params, "cpu")
    rng = np.random.default_rng(params.poly_modulus_degree)
    for _ in range(2 if params is SMALL else 1):
        full, members, got = _expanded_both_ways(client, ev, rng.normal(size=params.slots))
        assert isinstance(members, sealio.SeededCiphertext) and members.prng_type == sealio.PRNG_BLAKE2XB
        assert np.array_equal(got.data.numpy().view(np.uint64), full.data) and got.scale == full.scale


#: primes = 1 mod 2N where SEAL's bound rejects ~3 % of the words (SEAL's own primes, just below a power of two,
#: reject about one word in 10^13: the redraws must be tested on primes like these)
REDRAWING_PRIMES = (1117984489316155393, 1054099661355286529, 997121301281701889)
#: two more (~1.5 %): four data primes redraw more words than one extra buffer holds
MORE_REDRAWING_PRIMES = (1135184250689814529, 1069376468041187329)


def _seeded_zero(primes: tuple[int, ...], security=sa.SEC_LEVEL_TYPE.TC128):
    """(the seeded members, SEAL's load of them [2, L, N]) of an encryption of zero in a context of ``primes``."""
    parms = sa.EncryptionParameters(sa.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(8192)
    parms.set_coeff_modulus([sa.Modulus(q) for q in primes])
    context = sa.SEALContext(parms, True, security)
    payload = seal.to_bytes(sa.Encryptor(context, sa.KeyGenerator(context).secret_key()).encrypt_zero_symmetric())
    members = sealio.read_fresh_ct_members(sealio.open_object(payload, 1 << 30), 8192)
    want = sealio.read_ciphertext(seal.to_bytes(seal.from_bytes_in("ciphertext", context, payload)), 8192, 8)
    return members, want


def test_the_redraws_are_seals_on_primes_that_reject_often():
    primes = list(REDRAWING_PRIMES[:2])                                 # the data level (the last is special)
    for _ in range(3):
        members, want = _seeded_zero(REDRAWING_PRIMES)
        assert isinstance(members, sealio.SeededCiphertext) and members.c0.shape == (2, 8192)
        assert _rejections(members, primes) > 300                      # ~3 % of 16384 words redrawn
        got = uniform.sample_poly_uniform(members.seed, primes, 8192, torch.empty((2, 8192), dtype=torch.int64))
        assert np.array_equal(got.numpy().view(np.uint64), want.data[1])


def test_too_few_extra_words_draws_more_with_the_same_result(monkeypatch):
    client = CKKSClient(SMALL, ())
    ev = GpuEvaluator(SMALL, "cpu")
    payload = client.encrypt_bytes(np.ones(SMALL.slots))
    want = ev.deserialize(payload)                                     # through SEAL
    monkeypatch.setattr(uniform, "_extra_words", lambda primes, n: 0)   # one refill at a time
    assert torch.equal(ev.deserialize_fresh(payload).data, want.data)
    # and where there are redraws to make, more than the first extra buffer holds
    members, want = _seeded_zero(REDRAWING_PRIMES[:2] + MORE_REDRAWING_PRIMES + REDRAWING_PRIMES[2:],
                                 sa.SEC_LEVEL_TYPE.NONE)
    draws, real = [], uniform.stream_words
    monkeypatch.setattr(uniform, "stream_words", lambda *a: draws.append(a[2]) or real(*a))
    primes = list(REDRAWING_PRIMES[:2] + MORE_REDRAWING_PRIMES)
    got = uniform.sample_poly_uniform(members.seed, primes, 8192, torch.empty((4, 8192), dtype=torch.int64))
    assert np.array_equal(got.numpy().view(np.uint64), want.data[1])
    assert _rejections(members, primes) > 512 and len(draws) >= 2  # > one extra buffer


def test_a_seed_of_another_prng_or_in_another_frame_is_left_to_seal():
    client = CKKSClient(SMALL, ())
    ev = GpuEvaluator(SMALL, "cpu")
    payload = client.encrypt_bytes(np.zeros(SMALL.slots))
    members = sealio.read_fresh_ct_members(sealio.open_object(payload, 1 << 30), SMALL.poly_modulus_degree)
    members.prng_type = sealio.PRNG_SHAKE256
    shake = sealio.write_seeded_ciphertext(members)
    assert ev.deserialize_fresh(shake) is None
    # SEAL expands it with its Shake256 PRNG (another c1, still a valid ciphertext): the fallback takes it
    assert ev.deserialize(shake).data.shape == (2, ev.top, SMALL.poly_modulus_degree)
    members.prng_type = sealio.PRNG_BLAKE2XB
    assert ev.deserialize_fresh(sealio.write_seeded_ciphertext(members)) is not None   # our writer = SEAL's bytes
    assert ev.deserialize_fresh(sealio.write_seeded_ciphertext(members)[:-1]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_kernel_and_the_expansion_are_the_references_and_seals():
    """On a card: the Triton Blake2xb kernel equals the torch reference, and the evaluator's expansion SEAL's load."""
    from fhe.backends.gpu.blake2xb_triton import xof_blocks

    for first, count in ((0, 1), (3, 777)):
        roots = torch.from_numpy(blake2xb.refill_roots(bytes(range(64)), first, count).view(np.int64).copy())
        assert torch.equal(xof_blocks(roots.cuda()).cpu(), blake2xb.xof_blocks_torch(roots))
    params = ckks_params_for("sqexp", 6)
    client = CKKSClient(params, ())
    ev = GpuEvaluator(params, "cuda")
    full, _, got = _expanded_both_ways(client, ev, np.random.default_rng(5).normal(size=params.slots))
    assert np.array_equal(got.data.cpu().numpy().view(np.uint64), full.data) and got.scale == full.scale
    members, want = _seeded_zero(REDRAWING_PRIMES)                      # the redraws, on the card
    got = uniform.sample_poly_uniform(members.seed, list(REDRAWING_PRIMES[:2]), 8192,
                                      torch.empty((2, 8192), dtype=torch.int64, device="cuda"))
    assert np.array_equal(got.cpu().numpy().view(np.uint64), want.data[1])
