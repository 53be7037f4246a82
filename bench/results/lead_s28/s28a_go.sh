# Session 28's first device call (lead): session 27's work, never run on a card. The CUDA tests of the changed
# graph path and of the L2 prefetch; the prefetch microbench; the engine's batch-1 step with the prefetch
# A/B/B/A (both shapes, bf16 and int4). Run: `bash .carry/multi.sh s28a:585` carrying .carry/lead, .carry/s28a,
# .carry/setup.sh, .carry/multi.sh. Predictions: bench/results/lead_s27/predictions.md (written before any run).
. .carry/setup.sh s28a || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/smi.txt
PYT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. CUDA tests: decode graphs that gather their ids and take their argmax, one upload a step, reused events,
the L2 prefetch alone, in a graph and in the engine"
timeout 210 $PYT tests/kernels/test_l2_prefetch.py tests/engine/test_spec_decode_gpu.py tests/engine/test_engine_gpu.py \
  -k "l2_prefetch or fp32_gpu_engine_equals or mixed_steps or overlapped_loop or pdl_keeps or verify or speculative" \
  > $R/tests.log 2>&1
el "tests rc=$?"; tail -6 $R/tests.log; tar czf $OUT/all.tgz -C $R .
el "2. does a prefetched GEMV read from L2 (cold / after a prefetch gap µs ahead / hot)"
timeout 80 python3 bench/l2_prefetch_gpu.py --json $R/micro.json > $R/micro.log 2>&1
el "micro rc=$?"; tail -30 $R/micro.log; tar czf $OUT/all.tgz -C $R .
el "3. L2 prefetch A/B/B/A in the engine's batch-1 step"
timeout $(( 560 - $(date +%s) + T0 )) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --l2-prefetch-mb 0,32,32,0 --json $R/l2.json > $R/l2.log 2>&1
el "rc=$?"; grep -v '^{' $R/l2.log | tail -24
el done
