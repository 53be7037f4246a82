#!/bin/bash
# usage: s23_ab.sh LABEL TREE OUTDIR module...   (one pytest process for all the modules, under the bench lock)
label=$1; tree=$2; out=$3; shift 3
cd $tree
start=$(date -u +%T)
flock /tmp/cipherlm-bench.lock nice -n 5 /usr/bin/time -f "%e s wall, %U s user, %S s sys, %M KB max RSS" env PYTHONPATH=$tree /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 "$@" > $out/$label.log 2>&1
echo "$start-$(date -u +%T) $label $(grep -E 'passed|failed' $out/$label.log | tail -1) | $(tail -1 $out/$label.log) | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/ab_summary.txt
