"""The engine core's per-row cost of streamed outputs with load coalescing in the core (eng22-s21), CPU, stub
executor (no model), real tokenizer: delta tuples every step (delta_coalescing 0: main's core, whose API process
held the tokens) vs the core holding a request's delta until 1 + R // 96 tokens are in (3 at 256 requests), each
step's batch pickled as the core sends it; also the bytes sent. 256 requests x (128 prompt + 256 output) tokens,
the sampled tokens ordinary words; rounds alternate; CPU time (process_time: the box is shared).
    PYTHONPATH=. python bench/results/eng22_s21/core_coalesce_cpu.py TOKENIZER_DIR"""
import json
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler

import torch

from bench.engine_host_cpu import OUTPUT_LEN, PROMPT_LEN, C
from bench.serve_api_cpu import HIDDEN_VOCAB, stub_parts
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine_core import StepBatch, encode
from engine.llm import LLM
from engine.model import LlamaForCausalLM
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

tok = Tokenizer.from_folder(sys.argv[1])


SENT = {}


def job(llm, seed: int, fast: bool) -> float:
    eng = llm.engine
    eng.output_processor.cumulative = False
    eng.emit_deltas, eng.stream_outputs = True, True  # as in the core process (LLM turns streaming off)
    eng.delta_coalescing = 96 if fast else 0
    sent = [0, 0]
    g = torch.Generator().manual_seed(seed)
    for i in range(C):
        eng.add_request(f"r{seed}-{i}", torch.randint(600, 4600, (PROMPT_LEN,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True))
    t0 = time.process_time()
    while eng.has_unfinished_requests():
        outs = eng.step()
        deltas = [o if type(o) is tuple else encode(o) for o in outs]
        sent[0] += len(deltas)
        sent[1] += len(ForkingPickler.dumps(("step", StepBatch(deltas, eng.stats(), [], [], 0, 0, []))))
    SENT[fast] = sent
    return time.process_time() - t0


res = {}
cfg = ModelConfig(model_type="llama", vocab_size=HIDDEN_VOCAB, hidden_size=8, intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=4096, tie_word_embeddings=True)
conf = EngineConfig(device="cpu", max_num_seqs=C, max_num_batched_tokens=8192, max_model_len=4096,
                    async_scheduling=True, gc_freeze=True)
llm = LLM(LlamaForCausalLM(cfg), tokenizer=tok, engine_config=conf, parts=stub_parts())
job(llm, 0, True)
for r in range(3):
    for fast in ((False, True) if r % 2 == 0 else (True, False)):
        res.setdefault(fast, []).append(job(llm, r + 1, fast))
for k, v in res.items():
    print(json.dumps({"delta_coalescing": 96 if k else 0, "job_cpu_s": [round(x, 3) for x in v],
                      "deltas_per_row_step": round(SENT[k][0] / (C * OUTPUT_LEN), 3),
                      "bytes_per_row_step": round(SENT[k][1] / (C * OUTPUT_LEN), 1),
                      "us_per_row_step": round(1e6 * statistics.median(v) / (C * OUTPUT_LEN), 2)}))
