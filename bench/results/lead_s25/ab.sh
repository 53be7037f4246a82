# usage: ab.sh ROUNDS [extra args]: base (HEAD at start) vs main, alternating
TOK=/root/.cache/cipherlm/models/SmolLM2-135M-Instruct
R=$1; shift
for i in $(seq $R); do
  for t in base main; do
    d=/work/main; [ $t = base ] && d=/work/wt/base
    cp /work/main/bench/core_served.py $d/bench/core_served.py 2>/dev/null
    (cd $d && PYTHONPATH=$d flock /tmp/cipherlm-bench.lock /work/main/.venv/bin/python -m bench.core_served --tok $TOK --label $t "$@")
  done
done
