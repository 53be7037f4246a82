# eng22, session 21, the one device call (bench/results/eng22_s21/predictions.md; this script is
# bench/results/eng22_s21/call_run.sh). Serving bench of issue 19 item 4 on one card:
# (A) main 0d72770 at its defaults, 256 users, with the offline engine at 256 and py-spy of the API + core;
# (B) this branch at its defaults, 256 users, py-spy; (C) B + admission_delay_steps=8;
# (E) this branch at 1 and 32 users with the offline engine; (D) C + stream_coalesce_streams=32, if time is left.
. .carry/setup.sh eng22
R=/tmp/r; mkdir -p $R/spy /tmp/s/base
tar -xJf $C/base.tar.xz -C /tmp/s/base || exit 1
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
smi | tee $R/smi.txt; nproc | tee -a $R/smi.txt; lscpu | grep -i "model name" | tee -a $R/smi.txt
mkdir -p /tmp/pyspy && python3 -m zipfile -e $C/py_spy-*.whl /tmp/pyspy && PS=$(ls /tmp/pyspy/*.data/scripts/py-spy) \
  && chmod +x $PS && $PS --version
python3 bench/random_model.py --like $C/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 4 --duration 3"
S=""; [ -x "$PS" ] && S="--py-spy $R/spy --py-spy-bin $PS"  # no py-spy: the runs go on without it
left() { echo $(( ${BUDGET:-318} - $(date +%s) + T0 )); }
show() { grep -v Warn $1 | grep -v '^{' | grep '|' | tail -${2:-3}; }
el serve-main
(cd /tmp/s/base/tree && PYTHONPATH=/tmp/s/base/tree:/tmp/site timeout 80 $B --offline --label main --users 256 $S \
  --json $R/serve_main.json) > $R/serve_main.log 2>&1
el "rc=$?"; show $R/serve_main.log 4
el serve-branch
timeout 55 $B --label branch --users 256 $S --json $R/serve_branch.json > $R/serve_branch.log 2>&1
el "rc=$?"; show $R/serve_branch.log
el serve-delay8
timeout 55 $B --label delay8 --users 256 --engine-set admission_delay_steps=8 $S --json $R/serve_delay8.json \
  > $R/serve_delay8.log 2>&1
el "rc=$?"; show $R/serve_delay8.log
L=$(left); el "low gets ${L}s"
[ $L -gt 30 ] && { timeout $(( L < 80 ? L : 80 )) $B --offline --label low --users 1 32 --json $R/serve_low.json \
  > $R/serve_low.log 2>&1; el "rc=$?"; show $R/serve_low.log 6; }
L=$(left); el "c32 gets ${L}s"
[ $L -gt 35 ] && { timeout $L $B --label delay8c32 --users 256 --engine-set admission_delay_steps=8 \
  --server-set stream_coalesce_streams=32 --json $R/serve_delay8c32.json > $R/serve_delay8c32.log 2>&1
  el "rc=$?"; show $R/serve_delay8c32.log; }
for f in $R/spy/*_256_*.txt; do [ -s $f ] || continue; echo "== $(basename $f)"
  python3 bench/profile_summary.py $f --rate 100 --top 12 2>/dev/null | head -16; done > $R/spy_summary.txt
smi | tee -a $R/smi.txt
el done
