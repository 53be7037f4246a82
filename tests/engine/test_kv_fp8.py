"""The engine with fp8 (e4m3) KV pools (``EngineConfig.kv_cache_dtype``): config, pools, scales, quality.

On CPU the fp8 pools run through the kernels' torch references (the same store / attention arithmetic the
Triton kernels are tested against in tests/kernels/test_kv_fp8.py); the CUDA engine is checked in
tests/engine/test_engine_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.errors import ParallelConfigError
from engine.kv_cache import FP8_MAX, KV_SCALE_HEADROOM, PagedKVCache, calibrate_kv_scales
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import random_prompts, tiny_model

FP8 = torch.float8_e4m3fn


def _engine(kv_cache_dtype: str, variant: str = "llama-gqa", **kw) -> LLM:
    cfg = EngineConfig(device="cpu", kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=4 << 20, max_model_len=256,
                       **kw)
    return LLM(tiny_model(variant), engine_config=cfg)


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ParallelConfigError, match="tensor parallelism"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2)
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8").resolved_kv_cache_dtype() == FP8
    assert EngineConfig(device="cpu").resolved_kv_cache_dtype() == torch.float32


def test_fp8_pools_hold_a_quarter_of_the_fp32_bytes_per_token():
    """Same byte budget: four times the blocks; the CPU's fused decode and fp32 attention path step aside."""
    ref, fp8 = _engine("auto"), _engine("fp8_e4m3")
    r, f = ref.engine.runner, fp8.engine.runner
    assert f.kv.k[0].dtype == FP8 and f.kv.quantized and not r.kv.quantized
    per_token = [x.kv.nbytes / (x.kv.num_blocks * x.kv.block_size) for x in (r, f)]
    cfg = r.model_config
    assert per_token == [2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * n for n in (4, 1)]
    assert fp8.engine.num_blocks == 4 * ref.engine.num_blocks
    assert f.fused_decode is None and not f.cpu_attention
    assert all(s.shape == (cfg.num_key_value_heads,) and s.dtype == torch.float32 for s in f.kv.k_scale + f.kv.v_scale)


@torch.inference_mode()
def test_calibrated_scales_cover_the_calibration_amax_with_headroom():
    model = tiny_model("qwen2-bias-tied")
    ks, vs = calibrate_kv_scales(model, 64)
    again = calibrate_kv_scales(model, 64)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, again[0] + again[1], strict=True))  # no request in it
    # a prefill of other ids: its K/V stay well inside the range the scales leave (amax * headroom)
    from engine.kv_cache import KVAmaxRecorder

    rec = KVAmaxRecorder(model.config.num_hidden_layers)
    ids = torch.tensor(random_prompts([48], vocab=model.config.vocab_size, seed=9)[0])
    model(ids, torch.arange(48), rec)
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        assert bool((rec.k_amax[layer] < k * FP8_MAX).all()) and bool((rec.v_amax[layer] < v * FP8_MAX).all())
        assert bool((rec.k_amax[layer] > k * FP8_MAX / KV_SCALE_HEADROOM / 4).all())  # not a blind constant


def test_copy_on_write_copies_fp8_blocks_exactly():
    model = tiny_model()
    scales = calibrate_kv_scales(model, 16)
    kv = PagedKVCache(model.config, 4, 4, FP8, "cpu", scales)
    kv.k[0].view(torch.uint8).copy_(torch.randint(0, 120, kv.k[0].shape, dtype=torch.uint8))
    kv.copy_blocks([(1, 3)])
    assert torch.equal(kv.k[0][3].view(torch.uint8), kv.k[0][1].view(torch.uint8))
    with pytest.raises(ValueError, match="per-head scales"):
        PagedKVCache(model.config, 4, 4, FP8, "cpu")


def _agreement(ref: list, got: list) -> dict:
    """Greedy runs of the same prompts with logprobs=5 (ref: fp32 pools): per prompt, the steps up to the
    first differing token must have close logprobs; where tokens part, the new token must have been a near
    tie in the reference (within ``tie`` nats of its top token)."""
    steps = same = 0
    worst_dlp, worst_tie, min_overlap = 0.0, 0.0, 5
    for (ta, la), (tb, lb) in zip(ref, got, strict=True):
        steps += len(ta)
        n = 0
        while n < len(ta) and ta[n] == tb[n]:
            worst_dlp = max(worst_dlp, abs(la[n][ta[n]] - lb[n][ta[n]]))
            min_overlap = min(min_overlap, len(set(la[n]) & set(lb[n])))
            n += 1
        same += n
        if n < len(ta):  # parted: how far below the reference's choice was the fp8 engine's choice?
            worst_tie = max(worst_tie, la[n][ta[n]] - la[n].get(tb[n], float("-inf")))
    return dict(share_same=same / steps, worst_dlp=worst_dlp, worst_tie=worst_tie, min_overlap=min_overlap)


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def _good(a: dict) -> bool:
    # share_same only guards against a vacuous comparison: a near tie early in a prompt legitimately parts the
    # rest of it (llama-gqa parts at a 0.002-nat tie)
    return a["share_same"] >= 0.5 and a["worst_dlp"] < 0.05 and a["worst_tie"] < 0.05 and a["min_overlap"] >= 3


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_fp8_greedy_stays_close_to_fp32_pools(variant):
    """Prefill (chunked: budget 32) and decode over fp8 pools vs fp32 pools, 6 prompts x 16 greedy steps
    crossing block boundaries; and the same check fails when the scales are wrong (K and V saturate), so it
    can."""
    prompts = random_prompts([5, 17, 33, 40, 64, 3], seed=3)
    kw = dict(block_size=16, max_num_batched_tokens=32)
    ref = _generate(_engine("auto", variant, **kw), prompts)
    llm = _engine("fp8_e4m3", variant, **kw)
    a = _agreement(ref, _generate(llm, prompts))
    assert _good(a), a
    with torch.inference_mode():  # sabotage: 1/200 of the calibrated scales saturates most of K and V
        for s in llm.engine.runner.kv.k_scale + llm.engine.runner.kv.v_scale:
            s.mul_(1 / 200)
    llm.engine.block_manager.enable_prefix_caching = False  # recompute the prompts' K with the bad scales
    bad = _agreement(ref, _generate(llm, prompts))
    assert not _good(bad), bad


def test_speculative_verify_steps_over_fp8_pools_equal_plain_decoding():
    """Verify steps (several query rows through the prefill path) read the same fp8 values a decode step
    does: greedy speculation gives the plain fp8 engine's tokens, with drafts accepted."""
    prompts = [p * 3 for p in random_prompts([5, 9, 12], seed=4)]  # repetitive: the n-gram proposer drafts
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, accepted = [], 0
    for k in (0, 3):
        llm = _engine("fp8_e4m3", num_speculative_tokens=k)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        accepted = llm.engine.stats().spec_num_accepted_tokens
    assert outs[0] == outs[1] and accepted > 0
