"""RFC 6962 Merkle hashing against the Certificate Transparency reference vectors."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from server.audit import MerkleFrontier, inclusion_proof, leaf_hash, merkle_root, verify_inclusion
from server.audit._merkle import EMPTY_ROOT

# RFC 6962 test inputs and tree heads (as used by the CT reference implementations).
LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
INCLUSION_0_OF_8 = [
    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
]


def test_reference_roots_recursive_and_incremental():
    hashed = [leaf_hash(x) for x in LEAVES]
    frontier = MerkleFrontier()
    assert frontier.root().hex() == ROOTS[0] == EMPTY_ROOT.hex()
    for n in range(1, 9):
        frontier.append(hashed[n - 1])
        assert merkle_root(hashed[:n]).hex() == ROOTS[n]
        assert frontier.root().hex() == ROOTS[n]


def test_reference_inclusion_proof():
    hashed = [leaf_hash(x) for x in LEAVES]
    proof = inclusion_proof(hashed, 0)
    assert [p.hex() for p in proof] == INCLUSION_0_OF_8
    assert verify_inclusion(hashed[0], 0, 8, proof, bytes.fromhex(ROOTS[8]))
    assert not verify_inclusion(hashed[1], 0, 8, proof, bytes.fromhex(ROOTS[8]))


def test_leaf_and_node_are_domain_separated():
    a, b = leaf_hash(b"a"), leaf_hash(b"b")
    # A two-leaf root must not equal the leaf hash of the concatenated children (second preimage).
    assert merkle_root([a, b]) != leaf_hash(a + b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=8), min_size=1, max_size=70))
def test_frontier_matches_definition_and_proofs_verify(data):
    hashed = [leaf_hash(x) for x in data]
    frontier = MerkleFrontier()
    for h in hashed:
        frontier.append(h)
    root = merkle_root(hashed)
    assert frontier.root() == root
    for i in (0, len(hashed) // 2, len(hashed) - 1):
        assert verify_inclusion(hashed[i], i, len(hashed), inclusion_proof(hashed, i), root)
