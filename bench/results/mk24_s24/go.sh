# mk24, session 24, the device call (bench/results/mk24_s24/predictions.md): the persistent decode kernel
# (kernels.decode_persistent, EngineConfig.cuda_persistent_decode). 1. its CUDA tests against the torch reference
# (P = SMs, CUDA-graph replays); 2. the engine's tests with the switch (greedy tokens, bf16 log-probs); 3. the
# microbench (persistent vs per-op vs decode-layer launches, A/B/C/C/B/A, the floor, a P sweep); 4. the engine's
# batch-1 step with the switch off/on/on/off on Qwen2.5-0.5B and Llama-3.2-1B, bf16, kernels per step.
# If the kernel's CUDA tests fail, the failure is printed and the engine rows (2 and 4) are skipped. <= 280 s.
. .carry/setup.sh mk24 || exit 1
END=$(( T0 + 278 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. persistent kernel on CUDA vs the torch reference (every spin loop is bounded; the whole step under timeout)"
timeout $(cap 75) $PT -x tests/kernels/test_decode_persistent.py -k "not subprocess" > $OUT/tests_kernel.log 2>&1
RC=$?; el "rc=$RC"
if [ $RC -eq 0 ]; then tail -4 $OUT/tests_kernel.log | cut -c1-300; else grep -E "Error|error|FAILED|assert" $OUT/tests_kernel.log | head -30 | cut -c1-400; tail -8 $OUT/tests_kernel.log | cut -c1-300; fi
if [ $RC -eq 0 ]; then
  el "2. the engine with cuda_persistent_decode: greedy tokens (fp32, graphs) and bf16 log-probs vs the switch off"
  timeout $(cap 60) $PT tests/engine/test_persistent_decode.py > $OUT/tests_engine.log 2>&1; el "rc=$?"
  tail -6 $OUT/tests_engine.log | cut -c1-300
else
  el "kernel tests FAILED (rc=$RC): skipping the engine rows (2 and 4)"
fi
el "3. microbench: layers of a batch-1 step, persistent vs per-op vs decode-layer (CUDA graphs, PDL on), floor, P sweep"
timeout $(cap 95) python3 -m bench.decode_persistent_gpu --shapes qwen2.5-0.5b,llama3.2-1b \
  --json $OUT/micro.json > $OUT/micro.log 2>&1; el "rc=$?"
grep -v -i warn $OUT/micro.log | grep -v '^{' | cut -c1-700 | tail -22
if [ $RC -eq 0 ]; then
  el "4. engine batch-1 step, persistent off/on/on/off, bf16, both shapes, kernels per step"
  timeout $(cap 200) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16 \
    --persistent off,on,on,off --count-kernels --json $OUT/ab.json > $OUT/ab.log 2>&1; el "rc=$?"
  grep -v -i warn $OUT/ab.log | cut -c1-400 | tail -16
fi
smi | tee -a $OUT/smi.txt
el done
