# Session 27's first device call (lead; built on a 2-core box, no GPU came that session): the CUDA tests of the
# changed graph path and of the L2 prefetch, the prefetch microbench, and where a batch-1 step's time goes.
# Run: `bash .carry/multi.sh s27a:480` carrying .carry/lead, .carry/s27a (go.sh = this file), .carry/setup.sh,
# .carry/multi.sh. Predictions: bench/results/lead_s27/predictions.md.
. .carry/setup.sh s27a || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/smi.txt
PYT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. CUDA tests: decode graphs that gather their ids and take their argmax, one upload a step, reused events
(the overlapped loop, mixed steps, verify graphs), the L2 prefetch alone, in a graph and in the engine"
timeout 220 $PYT tests/kernels/test_l2_prefetch.py tests/engine/test_spec_decode_gpu.py tests/engine/test_engine_gpu.py \
  -k "l2_prefetch or fp32_gpu_engine_equals or mixed_steps or overlapped_loop or pdl_keeps or verify or speculative" \
  > $R/tests.log 2>&1
el "tests rc=$?"; tail -4 $R/tests.log; tar czf $OUT/all.tgz -C $R .
el "2. does a prefetched GEMV read from L2 (cold / after a prefetch gap µs ahead / hot)"
timeout 90 python3 bench/l2_prefetch_gpu.py --json $R/micro.json > $R/micro.log 2>&1
el "micro rc=$?"; tail -40 $R/micro.log; tar czf $OUT/all.tgz -C $R .
el "3. a batch-1 step outside its graph: device timeline and host split (schedule / launch / wait)"
timeout 110 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 --profile \
  --json $R/profile.json > $R/profile.log 2>&1
el "profile rc=$?"; python3 - $R/profile.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["engine"]:
    t = r.get("timeline", {})
    print(r["shape"], r.get("step_ms"), r.get("replay_ms"), {k: t.get(k) for k in (
        "span_us_per_step", "busy_us_per_step", "idle_us_per_step", "largest_gaps_us", "rare_device_ops")},
          r.get("host"), r.get("error"))
PY
el done
