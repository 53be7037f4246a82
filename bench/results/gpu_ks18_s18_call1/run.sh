# ks18 (issue 16, session 18) device call: the 576x576 matmul variants beside TenSEAL mm, the decode step A/B
# (triton_ops.STRIDED off/on, interleaved, profiled), the CUDA tests of the strided NTT.
. .carry/setup.sh ks18
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
if [ -z "$SKIP_MM" ]; then
timeout ${MM_S:-90} python3 bench/gpu_attention.py --skip block --matmul-repeat ${MM_REPEAT:-20} --tenseal-repeat 3 \
  ${MM_VARIANTS:+--matmul-variants $MM_VARIANTS} --out $OUT/matmul.json > $OUT/matmul.log 2>&1
el "matmul rc=$? $(date -u +%H:%M:%S)"; grep "^matmul\|Error\|error" $OUT/matmul.log | tail -12
python3 -c "import json;d=json.load(open('$OUT/matmul.json'))['matmul'];print({k:v for k,v in d.items() if k!='variants'})"
fi
if [ -z "$SKIP_AB" ]; then
timeout ${AB_S:-120} python3 bench/gpu_step_ab.py --ab strided --profile --weights $C/smollm2 --contexts ${CTX:-128,512} \
  --repeat ${REPEAT:-10} --sessions ${SESSIONS:-8} --out $OUT/ab.json > $OUT/ab.log 2>&1
el "ab rc=$? $(date -u +%H:%M:%S)"; grep -v "^{\|^profile" $OUT/ab.log | tail -12
python3 -c "
import json;d=json.load(open('$OUT/ab.json'))
for n,p in d.get('profile_128',{}).items(): print(n, p['wall_ms_profiled'], p['kernels'], p['kernel_ms'], list(p['top'].items())[:6])
print(d['rotate_ms_before'], d['rotate_ms_after'], d.get('whole_steps'))"
fi
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
timeout ${TEST_S:-80} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/fhe/test_gpu_backend_cuda.py -k "${TESTS_K:-(ntt_matches and True-True) or n8192}" > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -8 $OUT/tests.log
fi
