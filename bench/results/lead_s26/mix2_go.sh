# Session 26's second GPU call (<= 340 s): `bash .carry/multi.sh mix2:340` with .carry/lead and .carry/mix2.
# 1. CUDA tests: mixed steps through decode graphs (the first call's memory failures were the test's own leak: a
#    spy closure through the gc-frozen runner), the overlapped loop, the in-partition merge (kernel + engine).
# 2. bench/core_served.py --model on the card (no HTTP: the core loop alone at 256 in-flight requests),
#    cuda_graph_mixed_tokens 256 / 0 alternating: wall and CPU per row-step, eager share, eager vs graph step ms.
#    Question: the first call's served rate was 13-16 % LOWER with mixed graphs (core-bound host): do the graphed
#    mixed steps cost the core more, or fewer sequences run per step?
# 3. The in-partition merge: bench/gpu_kernels.py --merge (the attention alone, graphs, batch 1 and 256), then
#    bench/int4_gpu.py --formats bf16 --merge off,on,on,off on both shapes (batch-1 engine step). Prediction
#    (helper's, written before): -0.5 to -1.5 µs a layer at 2-3 partitions (10-40 µs off Qwen's ~680 µs step).
. .carry/setup.sh mix2 || exit 1
R=/tmp/r; mkdir -p $R
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee $R/smi.txt
END=$(( T0 + 330 )); left() { echo $(( END - $(date +%s) )); }
el "tests"
timeout 80 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning \
  -rfE tests/engine/test_engine_gpu.py tests/kernels/test_paged_decode_merge.py -k "mixed_steps or overlapped_loop or merge" \
  > $R/tests.log 2>&1
el "tests rc=$?"; tail -6 $R/tests.log; tar czf $OUT/all.tgz -C $R .
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
for m in 256 0; do [ $(left) -gt 170 ] || break
  el "core_served mixed $m"
  timeout 60 python3 -m bench.core_served --model /tmp/smol --device cuda --rounds 2 --mixed-tokens $m --label m$m \
    2>&1 | grep -v Warn | tail -3 | tee -a $R/core_served.txt
  tar czf $OUT/all.tgz -C $R .
done
el "gpu_kernels --merge"
timeout 40 python3 bench/gpu_kernels.py --merge > $R/merge_kernel.txt 2>&1; tail -12 $R/merge_kernel.txt
tar czf $OUT/all.tgz -C $R .
el "int4_gpu --merge"
timeout $(( $(left) - 5 )) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 --merge off,on,on,off \
  --json $R/merge_engine.json > $R/merge_engine.txt 2>&1; tail -14 $R/merge_engine.txt
el done
