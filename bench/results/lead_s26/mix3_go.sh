# Carried to the next session (session 26 had no device time left for it; <= 300 s): `bash .carry/multi.sh mix3:300`
# with .carry/lead and .carry/mix3 (go.sh = this file). serve_bench now prints the eager share of the steps.
# Why: core_served on the card (call 2) put an eager mixed step at ~33 ms on these hosts (every CUDA launch of
# an eager step costs ~0.1 ms of host here) against ~5 ms for a graph step; in serving, a slow eager step lets
# ~12 prompts pile up, so the next step's prompts exceed cuda_graph_mixed_tokens=256 and run eagerly again.
# Prediction: with cuda_graph_mixed_tokens=2048 (the whole token budget) nearly every served step replays a
# graph and served tok/s rises >= 20 % over 0 (32-34k in call 1).
. .carry/setup.sh mix3 || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/smi.txt
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
el "start-up with the mixed buckets (graph captures) and the CUDA tests"
python3 - > $R/startup.txt 2>&1 <<'PY'
import gc
import time

import torch
from engine.engine_config import EngineConfig
from engine.llm import LLM
for m in (0, 2048, 0, 2048):
    t = time.perf_counter()
    llm = LLM("/tmp/smol", engine_config=EngineConfig(device="cuda", cuda_graph_mixed_tokens=m,
                                                             gpu_memory_utilization=0.3))
    print(f"cuda_graph_mixed_tokens={m}: engine ready in {time.perf_counter() - t:.1f} s, "
          f"{len(llm.engine.runner._graphs)} graphs", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
PY
cat $R/startup.txt
timeout 60 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning \
  -rfE tests/engine/test_engine_gpu.py -k mixed_steps > $R/tests.log 2>&1; el "tests rc=$?"; tail -2 $R/tests.log
tar czf $OUT/all.tgz -C $R .
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5 --users 256"
for v in m2048:2048:--offline m0:0 m2048b:2048 m0b:0; do IFS=: read n m x <<< "$v"; el "$n"
  timeout $([ -n "$x" ] && echo 100 || echo 60) $B --label $n --json $R/serve_$n.json \
    --engine-set cuda_graph_mixed_tokens=$m $x > $R/serve_$n.log 2>&1
  el "rc=$?"; grep "^| $n" $R/serve_$n.log | tail -2; tar czf $OUT/all.tgz -C $R .
done
el done
