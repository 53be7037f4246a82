# ks19 (issue 16, session 19) device call 1: the batched key switches (matmul BATCH_SWITCHES+giants_each vs not,
# decode A/B LOCAL_REG+STRIDED_REG off/on profiled, batch off/on, CUDA tests vs SEAL), the packed prefill profiled, the 4-layer e2e TPOT.
. .carry/setup.sh ks19
smi() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi
if [ -z "$SKIP_MM" ]; then
timeout ${MM_S:-60} python3 bench/gpu_attention.py --skip block --matmul-repeat 20 --tenseal-repeat 3 \
  --matmul-variants ${MM_VARIANTS:-hoist+graph+strided,hoist+graph+strided+batch,hoist+graph+strided+batch+reg} --out $OUT/matmul.json > $OUT/matmul.log 2>&1
el "matmul rc=$? $(date -u +%H:%M:%S)"; grep "^matmul\|Error" $OUT/matmul.log | tail -6
python3 -c "import json;d=json.load(open('$OUT/matmul.json'))['matmul'];print({k:v for k,v in d.items() if k!='variants'})"
fi
if [ -z "$SKIP_TESTS" ]; then
timeout ${TEST_S:-70} python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE \
  tests/fhe/test_gpu_backend_cuda.py -k "${TESTS_K:-n8192 or True-True}" > $OUT/tests.log 2>&1
el "tests rc=$? $(date -u +%H:%M:%S)"; tail -4 $OUT/tests.log
fi
if [ -z "$SKIP_AB" ]; then
for ab in ${AB:-reg batch}; do
[ $ab = reg ] && prof=--profile || prof=
[ $ab = reg ] && t=${AB_S:-100} ctx=${CTX:-16,128,512} || t=${AB2_S:-50} ctx=128
timeout $t python3 bench/gpu_step_ab.py --ab $ab $prof --weights $C/packed --contexts $ctx \
  --repeat ${REPEAT:-10} --sessions $([ $ab = reg ] && echo ${SESSIONS:-8} || echo 0) --out $OUT/ab_$ab.json >> $OUT/ab.log 2>&1
el "ab $ab rc=$? $(date -u +%H:%M:%S)"; grep -v "^{\|^profile" $OUT/ab.log | tail -4
python3 -c "
import json;d=json.load(open('$OUT/ab_$ab.json'))
for n,p in d.get('profile_128',{}).items(): print(n, p['wall_ms_profiled'], p['kernels'], p['kernel_ms'], list(p['top'].items())[:5])
print(d['rotate_ms_before'], d['rotate_ms_after'], d.get('whole_steps'))"
done
fi
smi
if [ -z "$SKIP_PACKED" ]; then
timeout ${PK_S:-90} python3 bench/gpu_packed.py --weights $C/packed --repeat ${PK_REPEAT:-2} --skip-seal --profile --out $OUT/packed.json > $OUT/packed.log 2>&1
el "packed rc=$? $(date -u +%H:%M:%S)"; grep -v "^ \|^{\|^}\|chunk profile" $OUT/packed.log | tail -8
python3 -c "
import json;d=json.load(open('$OUT/packed.json'));p=d.get('chunk_profile',{})
print({k:v for k,v in d.items() if k not in ('chunk_profile',)}); print(p.get('wall_ms_profiled'), p.get('kernels'), p.get('kernel_ms'), p.get('top'))"
fi
if [ -z "$SKIP_E2E" ]; then
python3 bench/gpu_e2e_home.py --tokenizer $C/tok --home /tmp/home > $OUT/home.log 2>&1; el "home rc=$?"; tail -1 $OUT/home.log
CIPHERLM_HOME=/tmp/home timeout ${E2E_S:-240} python3 bench/private_e2e.py --device cuda --plan /tmp/home/plan.json \
  --prompt-tokens 32 --max-tokens 64 --json $OUT/e2e.json > $OUT/e2e.log 2>&1
el "e2e rc=$? $(date -u +%H:%M:%S)"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -25
fi
smi; el done
