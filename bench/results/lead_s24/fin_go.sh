# Session 24, the last call (device budget ~500 s incl. the start): the persistent decode kernel (mk24) trimmed to
# fit, plus the attention kernels' card tests. Results are tarred into $OUT/fin.tgz after every step, so a call cut
# short by the budget still returns what finished. Order: kernel tests, microbench, engine rows (Qwen), attention
# tests, engine tests, Llama rows.
. .carry/setup.sh fin || exit 1
END=$(( T0 + 250 )); cap() { local l=$(( END - $(date +%s) )); l=$(( l < $1 ? l : $1 )); echo $(( l > 1 ? l : 1 )); }
O=/tmp/fin; mkdir -p $O; pack() { cp /tmp/fin.log $O/ 2>/dev/null; tar czf $OUT/fin.tgz -C /tmp fin; }
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $O/smi.txt
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
el "1. persistent kernel on CUDA vs the torch reference"
timeout $(cap 55) $PT -x tests/kernels/test_decode_persistent.py -k "not subprocess" > $O/tests_kernel.log 2>&1
RC=$?; el "rc=$RC"
if [ $RC -eq 0 ]; then tail -3 $O/tests_kernel.log | cut -c1-300; else grep -E "Error|error|FAILED|assert" $O/tests_kernel.log | head -25 | cut -c1-400; tail -6 $O/tests_kernel.log | cut -c1-300; fi
pack
el "2. microbench (1 round, no sweep)"
timeout $(cap 60) python3 -m bench.decode_persistent_gpu --shapes qwen2.5-0.5b,llama3.2-1b --rounds 1 --sweep-shapes none \
  --json $O/micro.json > $O/micro.log 2>&1; el "rc=$?"
grep -v -i warn $O/micro.log | grep -v '^{' | cut -c1-600 | tail -24; pack
if [ $RC -eq 0 ]; then
  el "3. engine batch-1 step, persistent off/on/on/off, Qwen bf16"
  timeout $(cap 70) python3 bench/int4_gpu.py --shapes qwen2.5-0.5b --formats bf16 --persistent off,on,on,off --count-kernels \
    --json $O/ab_qwen.json > $O/ab_qwen.log 2>&1; el "rc=$?"; grep -v -i warn $O/ab_qwen.log | grep -v '^{' | cut -c1-300 | tail -8; pack
fi
el "4. attention kernels (runtime partition / table width) on CUDA"
timeout $(cap 30) $PT tests/kernels/test_triton.py tests/kernels/test_kv_fp8.py tests/kernels/test_pdl.py -k "decode or prefill" \
  > $O/tests_attn.log 2>&1; el "rc=$?"; tail -2 $O/tests_attn.log | cut -c1-300; pack
if [ $RC -eq 0 ]; then
  el "5. engine with cuda_persistent_decode (greedy tokens, log-probs)"
  timeout $(cap 45) $PT tests/engine/test_persistent_decode.py > $O/tests_engine.log 2>&1; el "rc=$?"; tail -4 $O/tests_engine.log | cut -c1-300; pack
  [ $(cap 999) -gt 30 ] && { timeout $(cap 60) python3 bench/int4_gpu.py --shapes llama3.2-1b --formats bf16 --persistent on,off \
    --json $O/ab_llama.json > $O/ab_llama.log 2>&1; el "rc=$?"; grep -v -i warn $O/ab_llama.log | grep -v '^{' | cut -c1-300 | tail -6; }
fi
smi | tee -a $O/smi.txt; el done; pack
