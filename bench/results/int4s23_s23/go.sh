# int4s23, session 23, the device call (bench/results/int4s23_s23/predictions.md): the split-K and in-place-nibble
# int4 w32 GEMV launches (GemvInt4W32Tuning.split_k / mantissa_unpack) on CUDA against the torch reference; the
# sweep of every such launch per GEMM (CUDA graphs, PDL on, TB/s and share of the copy bandwidth, best per GEMM)
# on Llama-3.2-1B with the engine's batch-1 rows bf16 / int4 default / int4 best / int4 default, then on
# Qwen2.5-0.5B (GEMMs only), then, if time is left, bench/int4_gpu.py on Qwen with its best launches. <= 250 s.
. .carry/setup.sh int4s23 || exit 1
END=$(( T0 + 245 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $OUT/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
rows() { grep "^{" $1 | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); e=r.get('error')
    print(r['shape'][:6], r['format'], r.get('tunings', '-'), e[:150] if e else 'step %.3f ms (%.0f tok/s) replay %.3f ms share %.1f%%' % (
        r['step_ms'], r['tok_per_s'], r['replay_ms'], 100*r['share_measured']))"; }
el "1. w32 GEMV on CUDA vs the torch reference: the split / in-place launches among the tunings (bf16 cases),"
el "   counters back at zero, SiLU prologue split, every nibble position; then split-K with real PDL"
timeout $(cap 55) $PT tests/kernels/test_gemv_int4_w32.py -k "split or mantissa or (matches_reference and dtype0)" \
  > $OUT/tests_w32.log 2>&1; el "rc=$?"; tail -4 $OUT/tests_w32.log
timeout $(cap 20) $PT tests/kernels/test_pdl.py -k split_k > $OUT/tests_pdl.log 2>&1; el "rc=$?"; tail -3 $OUT/tests_pdl.log
el "2. Llama-3.2-1B: sweep per GEMM, then engine rows bf16 / int4 default / best / default"
timeout $(cap 125) python3 -m bench.gemv_int4_gpu --split-sweep --shapes llama3.2-1b --json $OUT/split_llama.json \
  > $OUT/split_llama.log 2>&1; el "rc=$?"
grep -E "^(copy|  BEST|\||BEST_W32)" $OUT/split_llama.log | cut -c1-300; rows $OUT/split_llama.log
el "3. Qwen2.5-0.5B: sweep per GEMM (no engine rows)"
timeout $(cap 50) python3 -m bench.gemv_int4_gpu --split-sweep --no-engine --shapes qwen2.5-0.5b \
  --json $OUT/split_qwen.json > $OUT/split_qwen.log 2>&1; el "rc=$?"
grep -E "^(  BEST|\||BEST_W32)" $OUT/split_qwen.log | cut -c1-300
if [ $(( END - $(date +%s) )) -gt 45 ] && [ -s $OUT/split_qwen.json ]; then
  el "4. bench/int4_gpu.py, Qwen, bf16 and int4 with the sweep's best launches"
  timeout $(cap 60) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b --formats bf16,int4 \
    --w32-tunings $OUT/split_qwen.json --json $OUT/int4_qwen_best.json > $OUT/int4_qwen_best.log 2>&1; el "rc=$?"
  grep -E "^(w32|\||int4 /)" $OUT/int4_qwen_best.log | cut -c1-300
fi
smi | tee -a $OUT/smi.txt
el done
