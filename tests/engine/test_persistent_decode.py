"""EngineConfig.cuda_persistent_decode (engine.fused + kernels.decode_persistent): batch-1 decode steps run every
layer in one persistent launch and compute the unfused path's function.

* CPU: the launcher runs its torch reference (the unfused ops layer by layer): the same logits and greedy tokens
  as the path without the switch, and only the one-row decode steps take it.
* CPU under ``TRITON_INTERPRET=1``: the kernel itself with one program (the interpreter runs programs one after
  another, so a grid barrier with more than one program would never open).
* CUDA (marked gpu): the engine with the switch on, CUDA graphs captured, generates the unfused engine's greedy
  tokens (fp32) and bf16 log-probs close to it.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from engine.fused import FusedLlama
from kernels import PersistentDecodeTuning
from kernels._common import HAS_TRITON, _interpreting
from tests.engine.engine_helpers import random_prompts, tiny_model
from tests.engine.test_fused import _paged_greedy, _paged_logits
from tests.engine.test_model import our_logits

INTERPRET = HAS_TRITON and _interpreting()


def _pair(variant: str = "qwen2-bias-tied", **on_kw) -> tuple[FusedLlama, FusedLlama, list[int]]:
    """(switch on, switch off) on copies of one tiny model; ``calls`` records the rows of persistent steps."""
    model = tiny_model(variant, seed=3)
    on = FusedLlama(copy.deepcopy(model), persistent_decode=True, **on_kw)
    off = FusedLlama(copy.deepcopy(model))
    calls: list[int] = []
    orig = on._forward_persistent
    on._forward_persistent = lambda *a: calls.append(a[0].shape[0]) or orig(*a)
    return on, off, calls


@pytest.mark.parametrize("variant", ["qwen2-bias-tied", "llama-gqa"])
@torch.inference_mode()
def test_persistent_decode_keeps_the_function_and_the_greedy_tokens(variant):
    on, off, calls = _pair(variant)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    torch.testing.assert_close(_paged_logits(on, ids, [13, 1, 1, 3]), _paged_logits(off, ids, [13, 1, 1, 3]),
                               rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]  # the two decode rows, not the prefill chunks
    prompt = ids[:9].tolist()
    assert _paged_greedy(on, prompt, 10) == _paged_greedy(off, prompt, 10)
    calls.clear()  # no paged pool (the dense cache): the other path
    torch.testing.assert_close(our_logits(on, ids, [13, 1]), our_logits(off, ids, [13, 1]), rtol=0, atol=0)
    assert calls == []


@torch.inference_mode()
def test_persistent_decode_skips_int4_weights():
    model = tiny_model("llama-gqa", seed=3)
    on = FusedLlama(copy.deepcopy(model), int4_group=16, persistent_decode=True)
    on._forward_persistent = None  # would raise if called
    ids = torch.tensor(random_prompts([9], seed=4)[0])
    assert _paged_logits(on, ids, [8, 1]).shape[0] == 9


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_persistent_decode_triton_kernel_keeps_the_greedy_tokens():
    """The kernel itself (Triton's interpreter, fp32, one program): logits within 1e-4 and the same tokens."""
    on, off, calls = _pair(kernel_backend="triton", persistent_tuning=PersistentDecodeTuning(programs=1, splits=2))
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    torch.testing.assert_close(_paged_logits(on, ids, [13, 1, 1]), _paged_logits(off, ids, [13, 1, 1]),
                               rtol=1e-4, atol=1e-4)
    assert calls == [1, 1]
    prompt = ids[:9].tolist()
    assert _paged_greedy(on, prompt, 5) == _paged_greedy(off, prompt, 5)
    assert not on._persistent[1].failed()


# ---- CUDA: the engine -------------------------------------------------------------------------------------

def _free_gpu_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _engine(persistent: bool, **kw):
    from engine.engine_config import EngineConfig
    from engine.llm import LLM

    cfg = EngineConfig(device="cuda", gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=8,
                       cuda_persistent_decode=persistent, **kw)
    return LLM(tiny_model("qwen2-bias-tied"), engine_config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_persistent_decode_keeps_the_greedy_tokens():
    """fp32 engines, CUDA graphs and the default PDL: each prompt alone (batch-1 steps: the persistent launch,
    captured in the batch-1 graph) and all together (the other paths) give the tokens of the engine without the
    switch; no launch gave up at a barrier."""
    import kernels
    from engine.sampling_params import SamplingParams

    prompts = random_prompts([5, 17, 33, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    try:
        for persistent in (False, True):
            llm = _engine(persistent, dtype="float32")
            model = llm.engine.runner.model
            assert model.persistent_decode == persistent and llm.engine.runner._graphs
            alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
            together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            tokens.append((alone, together))
            if persistent:
                assert model._persistent is not None and not model._persistent[1].failed()
            del llm, model
            _free_gpu_memory()
    finally:
        kernels.set_pdl(False)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_persistent_decode_bf16_logprobs_close():
    """bf16: the first decode steps' top-5 log-probs with the switch are those without, to bf16 precision."""
    import kernels
    from engine.sampling_params import SamplingParams

    prompt = random_prompts([40], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=5)
    got = []
    try:
        for persistent in (False, True):
            llm = _engine(persistent)
            got.append(llm.generate([prompt], params)[0].outputs[0])
            del llm
            _free_gpu_memory()
    finally:
        kernels.set_pdl(False)
    assert got[0].token_ids[0] == got[1].token_ids[0]
    off, on = got[0].logprobs[1], got[1].logprobs[1]
    scale = max(abs(v) for v in off.values())
    assert len(set(off) & set(on)) >= 4
    assert all(abs(on[t] - off[t]) < 2e-2 * scale for t in set(off) & set(on))
