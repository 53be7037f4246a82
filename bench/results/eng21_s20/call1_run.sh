# eng21, session 20, the one device call (bench/results/eng21_s20/call1_predictions.md). Same bench as the lead's
# call 1 (bench/results/gpu_lead_2026-12-06_s20_call1.sh), which did not run: (A) main 41a1006 at 256 users with
# the offline engine (the baseline: coalescing on, no admission delay); (B) this branch at 256 users (the core's
# delta tuples, the plain disconnect listener, the backend tokenizer) with py-spy on the API process and the core;
# (C) this branch with admission_delay_steps=8; (D) this branch at 1 and 32 users with the offline engine;
# (E) in the time left, (C) with stream_coalesce_streams=32.
. .carry/setup.sh eng21
R=/tmp/r; mkdir -p $R/spy /tmp/s/base
tar -xJf $C/base.tar.xz -C /tmp/s/base || exit 1
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $R/smi.txt
mkdir -p /tmp/pyspy && python3 -m zipfile -e $C/py_spy-*.whl /tmp/pyspy && PS=$(ls /tmp/pyspy/*.data/scripts/py-spy) \
  && chmod +x $PS && $PS --version
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 3"
S="--py-spy $R/spy --py-spy-bin $PS"
el serve-main
(cd /tmp/s/base/tree && PYTHONPATH=/tmp/s/base/tree:/tmp/site timeout 75 $B --offline --label main --users 256 \
  --json $R/serve_main.json) > $R/serve_main.log 2>&1
el "rc=$?"; grep -v Warn $R/serve_main.log | grep -v '^{' | tail -6
el serve-branch
timeout 50 $B --label branch --users 256 $S --json $R/serve_branch.json > $R/serve_branch.log 2>&1
el "rc=$?"; grep -v Warn $R/serve_branch.log | grep -v '^{' | tail -3
el serve-delay8
timeout 50 $B --label delay8 --users 256 --engine-set admission_delay_steps=8 $S --json $R/serve_delay8.json \
  > $R/serve_delay8.log 2>&1
el "rc=$?"; grep -v Warn $R/serve_delay8.log | grep -v '^{' | tail -3
for f in $R/spy/*_256_*.txt; do [ -s $f ] || continue; echo "== $(basename $f)"
  python3 bench/profile_summary.py $f --rate 100 --top 10 2>/dev/null | head -12; done > $R/spy_summary.txt
head -30 $R/spy_summary.txt
el serve-low
timeout 70 $B --offline --label low --users 1 32 --json $R/serve_low.json > $R/serve_low.log 2>&1
el "rc=$?"; grep -v Warn $R/serve_low.log | grep -v '^{' | tail -8
LEFT=$(( 300 - $(date +%s) + T0 )); el "left ${LEFT}s"
if [ $LEFT -gt 40 ]; then  # (E) if time is left: the delay with coarser chunks (1 + S // 32 tokens: 9 at 256)
  timeout $LEFT $B --label delay8c32 --users 256 --engine-set admission_delay_steps=8 \
    --server-set stream_coalesce_streams=32 --json $R/serve_delay8c32.json > $R/serve_delay8c32.log 2>&1
  el "rc=$?"; grep -v Warn $R/serve_delay8c32.log | grep -v '^{' | tail -3
fi
smi | tee -a $R/smi.txt
el done
