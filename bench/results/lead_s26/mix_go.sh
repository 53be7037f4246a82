# Session 26's GPU check (<= 560 s): `bash .carry/multi.sh mix:560` with .carry/lead and .carry/mix (go.sh = this
# file, base.tar.xz = `git archive 2cd3427`, session 25's base) carried.
# 1. The CUDA tests of mixed steps through decode graphs (prompt tokens as rows): fp32 greedy tokens = the CPU
#    reference's with cuda_graph_mixed_tokens 256 and 0, overlapped and not; the older graph / overlap tests.
# 2. 256 streamed users on the SmolLM2 shape (8 client processes), alternating: mixed graphs on (the new default,
#    with the offline peer), off (cuda_graph_mixed_tokens=0: session 25's engine), session 25's base 2cd3427 (its
#    core-CPU claim: base vs off), on, off.
# Predictions (written before the run): with mixed graphs on, served steps replay graphs ~95 % of the time
# instead of ~12 %; served TPOT p50 down ~0.5-1 ms; served / offline at 256 users >= 75 % (67 % in session 23 on
# an H100, 72 % with admission delay 8); off vs base: the core's CPU per token down 15-30 % (session 25).
. .carry/setup.sh mix || exit 1
R=/tmp/r; mkdir -p $R /tmp/s/base
tar -xJf $C/base.tar.xz -C /tmp/s/base || exit 1
trap 'tar czf $OUT/all.tgz -C $R .' EXIT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee $R/smi.txt; nproc >> $R/smi.txt
lscpu | grep -i "model name" | tee -a $R/smi.txt
END=$(( T0 + 550 )); left() { echo $(( END - $(date +%s) )); }
el "tests"
timeout 110 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q -W ignore::pytest.PytestUnknownMarkWarning \
  -rfE tests/engine/test_engine_gpu.py -k "mixed_steps or fp32_gpu_engine or overlapped_loop" > $R/tests.log 2>&1
el "tests rc=$?"; tail -4 $R/tests.log
[ -d /tmp/smol ] || python3 bench/random_model.py --like .carry/lead/tok --out /tmp/smol > /dev/null || exit 1
B="python3 bench/serve_bench.py --model /tmp/smol --device cuda --output-len 128 --input-len 100 --request-rate inf --clients 8 --duration 5 --users 256"
row() {
  python3 - $1 <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (list, dict))})
PY
}
run() {  # run NAME TREE TIMEOUT [extra args]
  n=$1 t=$2 s=$3; shift 3; [ $(left) -gt $(( s * 2 / 3 )) ] || { el "skip $n"; return; }
  s=$(( s < $(left) ? s : $(left) )); el "$n ($s s)"
  (cd $t && PYTHONPATH=$t:/tmp/site timeout $s $B --label $n --json $R/serve_$n.json "$@") > $R/serve_$n.log 2>&1
  el "rc=$?"; row $R/serve_$n.json 2>/dev/null | tee -a $R/rows.txt
  tar czf $OUT/all.tgz -C $R .
}
HERE=$PWD
run on1 $HERE 100 --offline
run off1 $HERE 60 --engine-set cuda_graph_mixed_tokens=0
run base /tmp/s/base 60
run on2 $HERE 60
run off2 $HERE 60 --engine-set cuda_graph_mixed_tokens=0
el done
