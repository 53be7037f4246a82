# pk23, session 23 (issue 16, the packed prefill <= 0.5 s per layer): (1) main vs the babies stacked once per map
# (fhe.packed.STACK_BABIES) vs that + 16 GiB of kept projection diagonals (PLAIN_CACHE_BYTES), in turn in ONE
# process (bench/gpu_packed.py --ab-cache):
# SmolLM2 layer 3's real attention weights and 32 real block inputs, the shipped plan, N = 32768, chunk B = 28,
# the 28-token chunk and the 32 tokens as the SDK sends them (chunk + 4 single-token steps, their whole-step graphs
# captured before the A/B), outputs compared residue for residue; (2) the packed prefill's CUDA tests (the new one
# first). Under 200 s: the bench ~60-80 s (its SEAL key generation ~26 s of it), the tests the rest.
. .carry/setup.sh pk23 || exit 1
L=$(dirname $C)/lead
S0=$(date +%s)
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader > $OUT/smi.txt; nproc >> $OUT/smi.txt
timeout 130 python3 bench/gpu_packed.py --weights $L/packed --repeat 5 --skip-seal --quick --ab-cache 16 \
  --out $OUT/packed.json > $OUT/packed.log 2>&1
el "packed rc=$?"; grep -v "^{" $OUT/packed.log | grep -v "^ " | tail -6 | cut -c1-900
LT=$(( 190 - $(date +%s) + S0 )); el "tests get ${LT}s"
[ $LT -gt 10 ] && timeout -s INT $LT $PT tests/fhe/test_gpu_backend_packed.py -k "kept or dot_with" > $OUT/tests.log 2>&1
el "tests (kept, dot_with) rc=$?"; tail -3 $OUT/tests.log
LT=$(( 195 - $(date +%s) + S0 ))
[ $LT -gt 10 ] && timeout -s INT $LT $PT tests/fhe/test_gpu_backend_packed.py -k "not kept and not dot_with" >> $OUT/tests.log 2>&1
el "tests (the others) rc=$?"; tail -3 $OUT/tests.log
el done
