# ks20 (issue 16, session 20), the one device call (no lead baseline came: this call carries its own).
# (1) decode step, three variants in turn (--ab s20x3: main = main's switches / fuse = SKIP_DIAG, FUSED_FINISH,
#     FUSED_CORRECTION / new = those + LAZY) at 16/128/512, profiled at 128; (2) the CUDA tests of the changed kernels
#     (= SEAL at N = 8192 and at the shipped size) and of the packed path; (3) the packed prefill at this tree's
#     defaults, --ab-main (main's switches on their own evaluator) and --ab-group 8 --ab-rows; (4) the sessions row
#     1/8/32 at 128, each session its own key set in device memory; (5) LOCAL_WARPS 4 / 8 if time is left.
. .carry/setup.sh ks20
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader; }
smi
timeout ${AB_S:-105} python3 bench/gpu_step_ab.py --ab ${AB:-s20x3} --profile --weights $C/packed \
  --contexts ${CTX:-16,128,512} --repeat ${REPEAT:-6} --sessions ${SESS:-0} --out $OUT/ab.json > $OUT/ab.log 2>&1
el "ab rc=$? $(date -u +%H:%M:%S)"; grep "^decode" $OUT/ab.log; grep -i "error\|Traceback" -A3 $OUT/ab.log | tail -8
python3 -c "
import json;d=json.load(open('$OUT/ab.json'))
for n,p in d.get('profile_128',{}).items(): print(n, p['wall_ms_profiled'], p['kernels'], p['kernel_ms'], [(k[:22],v['n'],v['ms']) for k,v in list(p['top'].items())[:9]])
print('rot', d['rotate_ms_before'], d.get('rotate_ms_after'), d.get('whole_steps'))" 2>&1 | cut -c1-700
timeout ${TEST_S:-55} $PT tests/fhe/test_gpu_backend_cuda.py tests/fhe/test_gpu_backend_packed.py \
  -k "${TESTS_K:-(n8192 and True-True) or (shipped and True-True) or (ntt_matches and True-True-True) or packed}" > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -4 $OUT/tests.log
smi
timeout ${PK_S:-80} python3 bench/gpu_packed.py --weights $C/packed --repeat 2 --skip-seal --quick --ab-main --ab-group 8 \
  --ab-rows --out $OUT/packed.json > $OUT/packed.log 2>&1
el "packed rc=$? $(date -u +%H:%M:%S)"; grep "^packed\|^ab" $OUT/packed.log | cut -c1-900; grep "Traceback" -A12 $OUT/packed.log | tail -6
LEFT=$(( ${END_S:-318} - $(date +%s) + T0 )); el "sessions get ${LEFT}s"
timeout $LEFT python3 bench/gpu_sessions.py --weights $C/packed --procs 1 --sessions 1,8,32 --rounds 3 --own-keys \
  --out $OUT/sessions.json > $OUT/sessions.log 2>&1
el "sessions rc=$? $(date -u +%H:%M:%S)"; grep "^{" $OUT/sessions.log | cut -c1-420; grep "Traceback" -A12 $OUT/sessions.log | tail -5
smi
LEFT=$(( ${END_S:-318} - $(date +%s) + T0 ))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 bench/gpu_step_ab.py --ab warps --weights $C/packed --contexts 128 --repeat 6 --sessions 0 \
    --out $OUT/warps.json > /tmp/warps.log 2>&1; el "warps rc=$?"; grep "decode @" /tmp/warps.log
fi
el done
