"""The engine core's per-row cost of streamed outputs, CPU, stub executor (no model), real tokenizer:
RequestOutput objects then encode() (before) vs OutputProcessor.delta tuples (emit_deltas, after), each step's
batch pickled as the core sends it. 256 requests x (128 prompt + 256 output) tokens, the sampled
tokens ordinary words; rounds alternate."""
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


def job(llm, seed: int, fast: bool) -> float:
    eng = llm.engine
    eng.output_processor.cumulative = False
    eng.emit_deltas, eng.stream_outputs = fast, True  # as in the core process (LLM turns streaming off)
    g = torch.Generator().manual_seed(seed)
    for i in range(C):
        eng.add_request(f"r{seed}-{i}", torch.randint(600, 4600, (PROMPT_LEN,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        deltas = [o if type(o) is tuple else encode(o) for o in outs]
        ForkingPickler.dumps(("step", StepBatch(deltas, eng.stats(), [], [], 0, 0, [])))
    return time.perf_counter() - t0


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
        res.setdefault("deltas" if fast else "outputs+encode", []).append(job(llm, r + 1, fast))
for k, v in res.items():
    print(json.dumps({"core_outputs": k, "job_s": [round(x, 3) for x in v],
                      "us_per_row_step": round(1e6 * statistics.median(v) / (C * OUTPUT_LEN), 2)}))
