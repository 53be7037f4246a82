"""Quality of the CUDA weight formats on the real default model, computed on the CPU (issue 19.3).

The fused forward of ``engine.fused`` runs on CPU with the kernels' torch references, in bf16 as on the
GPU, so each row is the function the GPU engine computes (to summation order) for:

* ``bf16`` — ``cuda_weight_format = "bf16"``;
* ``fp8-w8a8`` — ``"fp8"`` as a prefill chunk or a batch of more than 4 rows sees it: e4m3 per-channel
  weights, activations rounded to e4m3 per token (``kernels.scaled_mm_fp8``'s reference);
* ``fp8-weight-only`` — ``"fp8"`` as decode rows of up to 4 see it (``kernels.gemv_fp8``'s reference);
* ``int4-g32`` — ``"int4"`` at the default group of 32 (RTN, head included).

Each row: mean KL(fp32 || format) and greedy (top-1) agreement, teacher-forced on every position of
held-out chat prompts plus the fp32 model's greedy continuations, and perplexity on a text no prompt was
drawn from — the prompts, text and fp32 reference of ``bench/quant_cpu.py``.

    flock /tmp/cipherlm-bench.lock nice python -m bench.fp8_quality_cpu
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from torch import nn

import engine.fp8
from bench.quant_cpu import PROMPTS, ppl_text
from engine.fused import FusedLlama
from engine.model import DenseKVCache, greedy_generate


class RowsPath(nn.Module):
    """A fused fp8 model whose every product takes one path: the GEMV (weight-only) or the W8A8 GEMM."""

    def __init__(self, fused: FusedLlama, weight_only: bool) -> None:
        super().__init__()
        self.fused, self.config = fused, fused.config
        self.max_rows = 1 << 40 if weight_only else 0

    @contextlib.contextmanager
    def _path(self):
        saved = engine.fp8.GEMV_MAX_ROWS, engine.fp8.GEMV_MAX_BYTES
        engine.fp8.GEMV_MAX_ROWS = engine.fp8.GEMV_MAX_BYTES = self.max_rows
        try:
            yield
        finally:
            engine.fp8.GEMV_MAX_ROWS, engine.fp8.GEMV_MAX_BYTES = saved

    def forward(self, *args):
        with self._path():
            return self.fused(*args)

    def logits(self, h):
        with self._path():
            return self.fused.logits(h)


def build(model) -> dict[str, nn.Module]:
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.rotary.inv_freq = model.rotary.inv_freq.clone()  # fp32 angles, as the GPU runner keeps them
    return {"bf16": FusedLlama(copy.deepcopy(bf16)),
            "fp8-w8a8": RowsPath(FusedLlama(copy.deepcopy(bf16), fp8=True), weight_only=False),
            "fp8-weight-only": RowsPath(FusedLlama(copy.deepcopy(bf16), fp8=True), weight_only=True),
            "int4-g32": FusedLlama(copy.deepcopy(bf16), int4_group=32)}


@torch.inference_mode()
def logits_of(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    t = torch.tensor(ids)
    cache = DenseKVCache(model.config, len(ids), dtype)
    return model.logits(model(t, torch.arange(len(ids)), cache)).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    folder = default_model_dir()
    tok = Tokenizer.from_folder(folder)
    ref = load_model(folder)
    seqs = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        seqs.append(ids + greedy_generate(ref, ids, 16))
    ppl_ids = tok.encode(ppl_text())[:512]
    ref_logits = [logits_of(ref, s, torch.float32) for s in seqs]
    rows = {}
    for name, model in build(ref).items():
        t0 = time.process_time()
        kl, agree, n = 0.0, 0, 0
        for s, rl in zip(seqs, ref_logits, strict=True):
            ql = logits_of(model, s, torch.bfloat16)
            lp, lq = rl.log_softmax(-1), ql.log_softmax(-1)
            kl += float((lp.exp() * (lp - lq)).sum())
            agree += int((rl.argmax(-1) == ql.argmax(-1)).sum())
            n += len(s)
        lq = logits_of(model, ppl_ids, torch.bfloat16).log_softmax(-1)[:-1]
        ppl = float((-lq.gather(1, torch.tensor(ppl_ids[1:])[:, None]).mean()).exp())
        rows[name] = (kl / n, agree / n, n, ppl)
        print(f"# {name}: {time.process_time() - t0:.0f} CPU-s", flush=True)
    lr = logits_of(ref, ppl_ids, torch.float32).log_softmax(-1)[:-1]
    ref_ppl = float((-lr.gather(1, torch.tensor(ppl_ids[1:])[:, None]).mean()).exp())
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, SmolLM2-135M, "
          f"{len(PROMPTS)} chat prompts + 16 greedy tokens each, perplexity on {len(ppl_ids)} tokens")
    print(f"| format | KL vs fp32 | greedy agree | positions | perplexity (fp32: {ref_ppl:.3f}) |")
    print("|---|---|---|---|---|")
    for name, (kl, agree, n, ppl) in rows.items():
        print(f"| {name} | {kl:.5f} | {100 * agree:.1f} % | {n} | {ppl:.3f} |")


if __name__ == "__main__":
    main()
