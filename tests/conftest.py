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
