#!/bin/bash
# usage: s23_measure.sh TAG module...
cd /work/wt/suite23
tag=$1; shift
for m in "$@"; do
  b=$(basename $m .py)
  flock /tmp/cipherlm-bench.lock nice -n 5 env PYTHONPATH=$PWD /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 $m > bench/results/suite23_s23/${tag}_${b}.log 2>&1
  echo "$(date -u +%T) $m $(tail -1 bench/results/suite23_s23/${tag}_${b}.log)" >> bench/results/suite23_s23/${tag}_summary.txt
done
