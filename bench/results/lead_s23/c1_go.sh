# Session 23, device call 1 (lead). Issue 16: the seeded expansion's CUDA checks (gate for
# fhe.backends.gpu.uniform.CUDA_CHECKED), the two test_private_batched CUDA tests with a local home, the private
# e2e with seeded uploads (flag set in this carried tree only). Issue 19 item 4: serving at 256 users vs offline.
. .carry/setup.sh c1 || exit 1
L=$PWD/.carry/lead
PT="python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning -rfE"
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi; nproc; lscpu | grep -i "model name"
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
timeout 90 $PT tests/fhe/test_gpu_backend_seeded.py > $OUT/tests_seeded.log 2>&1; el "seeded tests rc=$?"; tail -3 $OUT/tests_seeded.log
timeout 50 python3 -m bench.seeded_expand --device cuda --repeat 30 --json $OUT/seeded_expand_cuda.json \
  > $OUT/expand.log 2>&1; el "expand rc=$?"; tail -8 $OUT/expand.log
timeout 45 python3 -m bench.worker_handoff --device cuda --repeat 5 --json $OUT/handoff_cuda.json \
  > $OUT/handoff.log 2>&1; el "handoff rc=$?"; tail -16 $OUT/handoff.log
python3 bench/gpu_e2e_home.py --tokenizer $L/tok --home /tmp/home > /tmp/home.log 2>&1; el "home rc=$?"
CIPHERLM_HOME=/tmp/home timeout 60 $PT -m "not heavy" tests/server/test_private_batched.py -k cuda > $OUT/batched.log 2>&1
el "batched rc=$?"; tail -3 $OUT/batched.log
cp fhe/backends/gpu/uniform.py /tmp/uniform.py.orig
sed -i 's/^CUDA_CHECKED = False$/CUDA_CHECKED = True/' fhe/backends/gpu/uniform.py && grep -n "^CUDA_CHECKED" fhe/backends/gpu/uniform.py
CIPHERLM_HOME=/tmp/home timeout 150 python3 bench/private_e2e.py --device cuda \
  --plan /tmp/home/plan.json --prompt-tokens 32 --max-tokens 32 --json $OUT/e2e_seeded.json > $OUT/e2e.log 2>&1
el "e2e rc=$?"; grep -v "encrypted token [0-9]*:" $OUT/e2e.log | tail -22
cp /tmp/uniform.py.orig fhe/backends/gpu/uniform.py
PS=/tmp/site/bin/py-spy; $PS --version || PS=
python3 bench/random_model.py --like $L/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 3"
mkdir -p /tmp/spy; S=""; [ -n "$PS" ] && S="--py-spy /tmp/spy --py-spy-bin $PS"
show() { grep -v Warn $1 | grep -v '^{' | grep '|' | tail -${2:-3}; }
T=$(left); el "serve gets ${T}s"
[ $T -gt 60 ] && { timeout $(( T < 90 ? T : 90 )) $B --offline --label main --users 256 $S --json $OUT/serve_256.json \
  > $OUT/serve_256.log 2>&1; el "rc=$?"; show $OUT/serve_256.log 4; }
T=$(left); el "delay8 gets ${T}s"
[ $T -gt 45 ] && { timeout $(( T < 60 ? T : 60 )) $B --label delay8 --users 256 --engine-set admission_delay_steps=8 \
  --json $OUT/serve_delay8.json > $OUT/serve_delay8.log 2>&1; el "rc=$?"; show $OUT/serve_delay8.log; }
for f in /tmp/spy/*_256_*.txt; do [ -s $f ] || continue; echo "== $(basename $f)"
  python3 bench/profile_summary.py $f --rate 100 --top 12 2>/dev/null | head -16; done > $OUT/spy_summary.txt
head -40 $OUT/spy_summary.txt; smi; el done
