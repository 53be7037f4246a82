import json, statistics, time, torch
from bench.engine_host_cpu import build, C, PROMPT_LEN, OUTPUT_LEN, VOCAB
from engine.sampling_params import SamplingParams
def job(llm, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(C)]
    t0 = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True))
    return time.perf_counter() - t0
res = {}
for mode in ("offline", "stream", "stream-deltas") * 2:
    llm = build(True, 183_000)
    llm.engine.stream_outputs = mode != "offline"
    llm.engine.output_processor.cumulative = mode != "stream-deltas"
    job(llm, 0)
    res.setdefault(mode, []).extend(job(llm, i) for i in (1, 2))
for k, v in res.items():
    print(json.dumps({"outputs": k, "job_s": [round(x, 4) for x in v], "us_per_row_step": 1e6 * statistics.median(v) / (256 * 256)}))
