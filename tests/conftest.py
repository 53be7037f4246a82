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

# Two test processes (pytest-xdist, `python -m pytest -q -n 2`: README's and CI's command) share the 2 cores: much of
# the suite is one single-threaded Python/SEAL process waiting on another. Each test process keeps what SEAL freed in
# its memory pool and reuses it only for allocations of the same size, so what a worker runs decides its memory: the
# groups below keep modules in one worker, one after another; every other module is a unit of its own (its module
# fixtures built once), handed to whichever worker is free. pytest-xdist's own ``--dist loadgroup`` marks cannot do
# this under pytest 9 (it renames tests through an attribute pytest 9 no longer reads), so the scheduler below splits
# the tests by :func:`xdist_group` itself. Measured on the 2-core box: bench/results/suite24_s24/, docs/benchmarks.md.
#: module -> xdist group (all of tests/fhe/ is in "seal" too: :func:`xdist_group`)
XDIST_GROUPS = {
    # The encrypted SmolLM2 end-to-end modules, then tests/fhe/: ~12 minutes of SEAL in one process. The e2e modules
    # reach ~11 GB each at their peak (the offload e2e's worker holds ~24,000 encoded diagonals; the e2e module's
    # N = 16384 key sets in several processes), so never two at once, nor beside the shipped N = 32768 block
    # (tests/fhe/test_attention.py, ~5 GB while it runs); and tests/fhe/ reuses ~2 GB of their pool (apart, the two
    # workers held ~14 GB between them and reached ~20 GB with two private servers running).
    "tests/client_sdk/test_private_offload_e2e.py": "seal",
    "tests/client_sdk/test_private_parity.py": "seal",
    "tests/e2e/test_private_e2e.py": "seal",
    # each starts a Ray cluster on this machine
    "tests/server/test_ray_backend.py": "ray",
    "tests/server/test_ray_private_e2e.py": "ray",
    "tests/server/test_ray_settings.py": "ray",
    "tests/server/test_replicas.py": "ray",
}


def xdist_group(path: str) -> str:
    """The xdist group of a test module (its path from the repository root): tests/fhe/ and the modules of
    :data:`XDIST_GROUPS` by name, else the module itself."""
    if path.startswith("tests/fhe/"):
        return "seal"
    return XDIST_GROUPS.get(path, path)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n N`` without ``--dist`` means ``--dist loadgroup``: tests by :func:`xdist_group`
    (:func:`pytest_xdist_make_scheduler`)."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadgroup``: one work unit per :func:`xdist_group`, handed out in collection order (not the
    largest first): the "seal" group, collected early, starts within seconds and the other worker takes the rest."""
    if config.option.dist != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0])

        def add_node_collection(self, node, collection):
            # schemathesis names every operation's test alike (tests/server/test_fuzz.py: 14 items, one id), and a
            # work unit is keyed by id: number the repeats so that each is scheduled (by its index, as before)
            seen: dict[str, int] = {}
            unique = []
            for nodeid in collection:
                seen[nodeid] = seen.get(nodeid, 0) + 1
                unique.append(nodeid if seen[nodeid] == 1 else f"{nodeid} #{seen[nodeid]}")
            super().add_node_collection(node, unique)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.fixture(scope="module", autouse=True)
def _heap_back_after_the_module():
    """In an xdist worker, hand the heap's free pages back to the system after each module (glibc's ``malloc_trim``):
    models and tensors a module freed stay in the process's heap otherwise (~1 GB a SmolLM2 engine module), and two
    workers' leftovers add up (SEAL's pool is not the heap's: what it holds stays)."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


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
