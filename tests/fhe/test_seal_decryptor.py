"""The SEAL client's decryptor, made once per key set and reused: the same values as a fresh one, bit for bit,
for a restored key set too, and another key set never shares it."""

import numpy as np
import pytest

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)


@pytest.fixture(scope="module")
def client():
    return CKKSClient(P, ())


def test_reused_decryptor_gives_the_fresh_ones_bits(client):
    rng = np.random.default_rng(0)
    cts = [client.kit.drop_to(client.encrypt(rng.standard_normal(64)), level) for level in (3, 1, 2)]
    for ct in cts:
        fresh = seal.decrypt(client.kit, client.keys.secret, ct)   # a decryptor made for this call, as before
        assert np.array_equal(client.decrypt(ct), fresh)
    assert client.__dict__["_decryptor"] is not None
    first = client.__dict__["_decryptor"]
    client.decrypt(cts[0])
    assert client.__dict__["_decryptor"] is first   # made once per key set


def test_restored_and_other_key_sets(client):
    values = np.linspace(-1, 1, 32)
    again = CKKSClient.restore(P, (), client.unsafe_export_secret(), dict(client.public_blobs))
    ct = client.encrypt(values)
    assert np.array_equal(again.decrypt(ct), client.decrypt(ct))
    other = CKKSClient(P, ())
    assert not np.allclose(other.decrypt(ct)[:32], values, atol=1e-3)   # its own key, not a shared decryptor
    assert other.__dict__["_decryptor"] is not client.__dict__["_decryptor"]
