# Session 25's GPU check, part A (<= 240 s; run first): the served core on the card without HTTP.
# `bash .carry/multi.sh s25a:240 s25b:300` with .carry/lead, .carry/s25a (go.sh = this file, base.tar.xz =
# `git archive 2cd3427`: the session's start plus the harness) and .carry/s25b carried.
# bench/core_served.py --model on the random SmolLM2-shaped folder: 256 requests always in flight, the real CUDA
# engine (graphs, overlapped loop), wall and CPU per row-step, and eager mixed vs graph step times, for the
# session's base and this tree at admission_delay_steps 0 and 8. Predictions (written before): this tree's CPU
# per row-step 15-30 % under base's; a mixed step 1-3 ms slower than a graph step (the eager launches);
# delay 8 mixes in a prompt in ~10-15 % of steps instead of ~85 %, with a lower wall per row-step.
. .carry/setup.sh s25a || exit 1
R=/tmp/r; mkdir -p $R /tmp/s/base
tar -xJf $C/base.tar.xz -C /tmp/s/base && cp bench/core_served.py /tmp/s/base/bench/ || exit 1
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee $R/smi.txt; lscpu | grep -i "model name" | tee -a $R/smi.txt
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
END=$(( T0 + 235 )); left() { echo $(( END - $(date +%s) )); }
HERE=$PWD
for v in tree:0 base:0 tree:8 base:8; do t=${v%%:*}; d=${v#*:}; [ $(left) -gt 30 ] || break
  dir=$HERE; [ $t = base ] && dir=/tmp/s/base
  el "$t delay $d"
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout $(( $(left) - 3 )) python3 -m bench.core_served --model /tmp/smol \
    --device cuda --delay $d --rounds 3 --label $t) 2>&1 | grep -v Warn | tail -2 | tee -a $R/core_served.txt
  tar czf $OUT/all.tgz -C $R .
done
PS=/tmp/site/bin/py-spy; if $PS --version > /dev/null 2>&1 && [ $(left) -gt 40 ]; then
  el "tree delay 0 under py-spy: where an eager mixed step's host time goes (our launchers' checks, Triton's launcher, torch)"
  timeout $(( $(left) - 3 )) $PS record --rate 250 --format raw -o $R/core_spy.txt -- python3 -m bench.core_served \
    --model /tmp/smol --device cuda --rounds 2 --label spy > $R/core_spy.log 2>&1
  python3 bench/profile_summary.py $R/core_spy.txt --rate 250 --top 60 > $R/core_spy_summary.txt 2>&1
  head -75 $R/core_spy_summary.txt
fi
el done
