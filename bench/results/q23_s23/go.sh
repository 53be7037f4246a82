# q23, session 23, the device call (bench/results/q23_s23/predictions.md): the fused decode layers
# (EngineConfig.cuda_fused_decode_layers, kernels.decode_layer) — their CUDA tests against the torch references,
# the batch-1 engine step A/B/B/A (off,on,on,off) on Qwen2.5-0.5B and Llama-3.2-1B, bf16 and int4, with kernels
# per step; then each fused kernel against the unfused kernels it replaces; then the engine's GPU tests of the path.
# <= 300 s. Tables afterwards: python bench/results/q23_s23/tables.py <files_at>
. .carry/setup.sh q23 || exit 1
END=$(( T0 + 292 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. decode-layer kernels on CUDA vs their torch references (the PDL launches: the engine's; plain ones ran in the interpreter)"
timeout $(cap 55) $PT -x tests/kernels/test_decode_layer.py -k "not plain" > $OUT/tests_kernels.log 2>&1; el "rc=$?"
tail -4 $OUT/tests_kernels.log
el "2. batch-1 step, fused decode layers off/on/on/off, both shapes, bf16 and int4 (PDL on: the default)"
timeout $(cap 140) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --fused-layers off,on,on,off --count-kernels --json $OUT/ab.json > $OUT/ab.log 2>&1; el "rc=$?"
grep -v -i warn $OUT/ab.log | cut -c1-400 | tail -30
el "3. each fused kernel vs the unfused kernels it replaces (CUDA graphs, PDL on)"
timeout $(cap 50) python3 -m bench.decode_layer_gpu --shapes qwen2.5-0.5b,llama3.2-1b --formats bf16,int4 \
  --json $OUT/layer.json > $OUT/layer.log 2>&1; el "rc=$?"
grep -v -i warn $OUT/layer.log | cut -c1-600 | tail -6
el "4. the engine's GPU tests of the fused layers"
timeout $(cap 60) $PT tests/engine/test_engine_gpu.py -k fused_decode_layers > $OUT/tests_engine.log 2>&1; el "rc=$?"
tail -4 $OUT/tests_engine.log
smi | tee -a $OUT/smi.txt
el done
