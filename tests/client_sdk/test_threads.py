"""The SDK's torch thread count: applied around its own one-row torch work only, chosen per generation, results
unchanged.

``client_sdk._threads`` sets torch's intra-op threads for the runtime's decode steps and restores the
caller's setting after; prefills keep the caller's; the thread count must not change a logit (the same tokens and the
same values encrypted whatever the machine picks).
"""

from __future__ import annotations

import types

import pytest
import torch

from client_sdk._runtime import EncryptedBackend, PrivateRuntime, StepStats
from client_sdk._threads import ThreadScope, _own_running, running_others
from engine.config import ModelConfig
from engine.model import DenseKVCache, LlamaForCausalLM
from tests.client_sdk.test_runtime_seam import PlaintextServer, client_from_bundle, random_llama


@pytest.fixture
def torch_threads():
    """The test's torch thread count back as it was, whatever the test did."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def smol_shaped() -> LlamaForCausalLM:
    """SmolLM2-135M's layer shapes (hidden 576, MLP 1536, 9/3 heads of 64), 4 layers, a small vocabulary:
    products as wide as the client's, so torch's ops really split over threads."""
    return random_llama(ModelConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=64),
                        0.05)


class _CountingServer(PlaintextServer):
    """The seam's plaintext server, also noting torch's thread count while the client's forward runs."""

    def __init__(self, full: LlamaForCausalLM, max_len: int) -> None:
        super().__init__(full, max_len)
        self.threads_seen: list[int] = []

    def encrypted_attention(self, layer, start, x, stats):
        self.threads_seen.append(torch.get_num_threads())
        return super().encrypted_attention(layer, start, x, stats)


def _runtime(model) -> PrivateRuntime:
    client = types.SimpleNamespace(_exchange=None, timeout=types.SimpleNamespace(read=1.0), progress=None,
                                   key_store=None)
    rt = PrivateRuntime(client, cache_dir="unused")
    rt.model = model
    rt.manifest = types.SimpleNamespace(max_step_tokens=8, packed_chunk=0)
    return rt


def _decode_logits(full, rt, threads: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of a 6-token prefill and one decode token through the runtime's forward under ``threads``."""
    rt.thread_scope.fixed = threads
    server = _CountingServer(full, 16)
    backend = EncryptedBackend(server, DenseKVCache(full.config, 16), StepStats())
    first = rt.forward(backend, [5, 17, 3, 44, 9, 61], 0)
    return torch.stack([first, rt.forward(backend, [7], 6)]), server.threads_seen


def test_forward_runs_under_the_chosen_count_and_restores_the_callers(tmp_path, torch_threads):
    full = smol_shaped()
    rt = _runtime(client_from_bundle(full, tmp_path))
    torch.set_num_threads(2)   # the caller's own setting: a decode step under 1 gives 2 back
    logits2, seen2 = _decode_logits(full, rt, 2)
    logits1, seen1 = _decode_logits(full, rt, 1)
    assert torch.get_num_threads() == 2
    # the prefill (6 rows) under the caller's setting, the decode step under the scope's count
    assert seen1 == [2, 2, 1, 1] and seen2 == [2, 2, 2, 2]
    assert torch.equal(logits1, logits2)   # bit for bit: the thread count changes no value


def test_no_choice_or_several_rows_leave_torch_alone(torch_threads):
    scope = ThreadScope()
    torch.set_num_threads(2)
    with scope.applied():
        assert torch.get_num_threads() == 2
    scope.fixed = 1
    with scope.applied(rows=6):
        assert torch.get_num_threads() == 2
    with scope.applied():
        assert torch.get_num_threads() == 1 and scope.count == 1
    assert torch.get_num_threads() == 2


def test_restored_when_the_block_raises(torch_threads):
    scope = ThreadScope()
    scope.fixed = 1
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError), scope.applied():
        raise RuntimeError("a lost session")
    assert torch.get_num_threads() == 2


def test_choice_explicit_environment_then_per_step(monkeypatch, torch_threads):
    scope = ThreadScope()
    scope.choose(3)
    assert scope.step_count() == 3
    with pytest.raises(ValueError):
        scope.choose(0)
    monkeypatch.setenv("CIPHERLM_THREADS", "2")
    scope.choose()
    assert scope.step_count() == 2 and scope.reason == "$CIPHERLM_THREADS"
    monkeypatch.delenv("CIPHERLM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("engine.threads.physical_cores", lambda: 4)
    scope.choose()
    running = iter([0, 1, 5])   # the machine free, one task elsewhere, more than the cores
    monkeypatch.setattr("client_sdk._threads.running_others", lambda: next(running))
    assert [scope.step_count() for _ in range(3)] == [4, 3, 1]


def test_running_others_leaves_this_process_out(torch_threads):
    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    for _ in range(50):   # parallel regions whose OpenMP threads may still spin when the count is read
        x = torch.tanh(x @ x)
    assert running_others() >= 0
    assert _own_running() >= 1   # the reading thread itself


def test_generate_chooses_per_generation(monkeypatch):
    rt = _runtime(None)
    picked = []
    monkeypatch.setattr(rt.thread_scope, "choose", picked.append)
    monkeypatch.setattr(rt, "prepare", lambda: None)
    monkeypatch.setattr(rt, "max_len", lambda: 64)
    rt.threads = 2
    with pytest.raises(AttributeError):   # stops right after the choice: the stub has no model
        next(rt.generate([1, 2], types.SimpleNamespace(max_tokens=1)))
    assert picked == [2]


def test_refresh_repicks_inside_a_decode_step_only(monkeypatch, torch_threads):
    scope = ThreadScope()
    monkeypatch.delenv("CIPHERLM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("engine.threads.physical_cores", lambda: 2)
    scope.choose()
    running = iter([0, 1])   # free at the step's start, one task elsewhere after the server's answer
    monkeypatch.setattr("client_sdk._threads.running_others", lambda: next(running))
    torch.set_num_threads(2)
    with scope.applied():
        assert torch.get_num_threads() == 2
        scope.refresh()
        assert torch.get_num_threads() == 1 and scope.count == 1
    assert torch.get_num_threads() == 2
    scope.refresh()   # outside a block: nothing read, nothing set
    assert torch.get_num_threads() == 2


def test_a_verify_step_keeps_the_callers_count(tmp_path, torch_threads):
    """A speculative verify step is several rows: the caller's count, like a prefill (its bits must not depend on
    the count the machine picks)."""
    from client_sdk._speculate import Speculation

    full = smol_shaped()
    rt = _runtime(client_from_bundle(full, tmp_path))
    torch.set_num_threads(2)
    rt.thread_scope.fixed = 1
    rt.manifest.max_session_tokens, rt._tenant_limits = 16, {}   # no tenant limits to ask a server for
    server = _CountingServer(full, 16)
    backend = EncryptedBackend(server, DenseKVCache(full.config, 16), StepStats())
    rt.forward(backend, [5, 17, 3], 0)
    rows = Speculation(rt, 3).verify_forward(backend, [7, 9, 11], 3)
    assert rows.shape[0] == 3 and torch.get_num_threads() == 2
    assert server.threads_seen == [2, 2, 2, 2]       # prefill, then the verify step: two encrypted layers each
