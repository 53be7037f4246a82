"""Shared fixtures: tiny random models built with transformers (no hub access), the default model."""

from __future__ import annotations

import os

# One OpenMP thread per process, sleeping when idle: the suite runs a test process beside the servers
# and FHE workers it starts, on CI's 2 cores, and spinning OpenMP threads of several processes slow
# each other down many times over (engine/threads.py). Set before torch loads; inherited by children.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:   # not item.keywords: it holds path names too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default SmolLM2 folder (pulled on first use)."""
    from engine.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2_key_store(tmp_path_factory):
    """One SDK key store for the encrypted tests on SmolLM2 at the CI ring (N = 16384, 12 data primes: the
    one-layer plans of tests/e2e/test_private_e2e.py and tests/client_sdk/test_private_parity.py, the offload
    plan's layer 2 of tests/client_sdk/test_private_offload_e2e.py; one sqexp key-level set for all three).

    The first client that needs the key generates it (~8 s on 2 cores) and stores it; the others restore it
    from the store, the SDK's own path for a returning user (``PrivateRuntime._key_set``). Each server still
    receives, screens and loads the key itself. A test that needs a key no other test holds makes its own
    (tests/e2e/test_private_e2e.py's tenant B)."""
    from client_sdk import KeyStore
    from client_sdk.keystore import KdfParams, KeyStoreConfig

    return KeyStore.create(tmp_path_factory.mktemp("ks") / "store", "cipherlm tests",
                           config=KeyStoreConfig(kdf=KdfParams(name="scrypt", n=2**10)))
