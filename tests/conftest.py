"""Shared fixtures: tiny random models built with transformers (no hub access), the default model."""

from __future__ import annotations

import pytest
import torch


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
