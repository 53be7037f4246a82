# Session 25's GPU check, part B (<= 300 s, after part A on the same machine): `bash .carry/multi.sh s25a:240 s25b:300`;
# .carry/s25b/go.sh = this file, .carry/s25b/base.tar.xz = `git archive 2cd3427` (the session's
# start plus bench/core_served_cpu.py). 256 streamed users on the SmolLM2 shape, base and this tree alternating
# (base+offline, tree+offline, tree, base), 8 client processes (16-core host: the clients stay off the bound), then
# this tree once more under py-spy. Predictions (docs/benchmarks.md, session 25): the core's CPU per token down
# ~15-30 %, the served TPOT p50 down ~0.5-1 ms, served / offline at 256 users >= 70 %.
. .carry/setup.sh s25b || exit 1
R=/tmp/r; mkdir -p $R/spy /tmp/s/base
tar -xJf $C/base.tar.xz -C /tmp/s/base || exit 1
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee $R/smi.txt; nproc >> $R/smi.txt
lscpu | grep -i "model name" | tee -a $R/smi.txt
PS=/tmp/site/bin/py-spy; $PS --version > /dev/null 2>&1 || PS=
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5 --users 256"
END=$(( T0 + 290 )); left() { echo $(( END - $(date +%s) )); }
row() {  # the row and the step mix of one run's json
  python3 - $1 <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (list, dict))})
PY
}
run() {  # run NAME TREE TIMEOUT [extra args]
  n=$1 t=$2 s=$3; shift 3; [ $(left) -gt $(( s / 2 )) ] || { el "skip $n"; return; }
  s=$(( s < $(left) ? s : $(left) )); el "$n ($s s)"
  (cd $t && PYTHONPATH=$t:/tmp/site timeout $s $B --label $n --json $R/serve_$n.json "$@") > $R/serve_$n.log 2>&1
  el "rc=$?"; row $R/serve_$n.json 2>/dev/null | tee -a $R/rows.txt
  tar czf $OUT/all.tgz -C $R .
}
HERE=$PWD
run base1 /tmp/s/base 95 --offline
run tree1 $HERE 95 --offline
run tree2 $HERE 50
run base2 /tmp/s/base 50
[ -n "$PS" ] && run spy $HERE 55 --py-spy $R/spy --py-spy-bin $PS
for f in $R/spy/*.txt; do [ -s $f ] || continue; echo "== $(basename $f)"
  python3 bench/profile_summary.py $f --rate 100 --top 25 2>/dev/null | head -40; done > $R/spy_summary.txt
el done
