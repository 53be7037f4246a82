# The L2 prefetch on the card (issue 19 item 2, lead, session 27; built without a GPU: this session's asks found
# no machine). Run: `bash .carry/multi.sh l2pf:560` carrying .carry/lead, .carry/l2pf (go.sh = this file),
# .carry/setup.sh, .carry/multi.sh. Predictions: bench/results/lead_s27/predictions.md (written before any run).
. .carry/setup.sh l2pf || exit 1
R=/tmp/r; mkdir -p $R; trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/smi.txt
PYT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. the prefetch's CUDA tests (kernel alone and in a graph; engine tokens with it on, bf16 and int4)"
timeout 120 $PYT tests/kernels/test_l2_prefetch.py tests/engine/test_engine_gpu.py -k "l2_prefetch" > $R/tests.log 2>&1
el "tests rc=$?"; tail -3 $R/tests.log; tar czf $OUT/all.tgz -C $R .
el "2. does a prefetched GEMV read from L2 (microbench: cold / after a prefetch gap µs ahead / hot)"
timeout 90 python3 bench/l2_prefetch_gpu.py --json $R/micro.json > $R/micro.log 2>&1
el "micro rc=$?"; cat $R/micro.log | tail -70; tar czf $OUT/all.tgz -C $R .
el "3. the engine's batch-1 step, A/B/B/A per shape and format (PDL on, per-op path)"
timeout 330 python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --l2-prefetch-mb 0,32,32,0 --json $R/engine.json > $R/engine.log 2>&1
el "engine rc=$?"; grep -v '^{' $R/engine.log | tail -30
el done
