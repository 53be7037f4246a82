#!/bin/bash
# issue 18 item 2 (spec18-s10): before (main f4c5ea8, git archive in /tmp/s10-before) and after (this branch),
# the same command, one after the other, under the bench lock. Plan: the shipped offload plan cut to layers 2-3.
. /work/main/.venv/bin/activate
R=/work/wt/spec18-s10/bench/results
date -u; uptime
cd /tmp/s10-before && PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k 3 --max-tokens 16 \
  --offload-plan /tmp/s10_off2.json --json $R/private_spec_2026-12-04_spec18s10_before_k3.json \
  > $R/private_spec_2026-12-04_spec18s10_before_k3.log 2>&1
echo "before rc=$?"; date -u; uptime
cd /work/wt/spec18-s10 && PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k 3 --max-tokens 16 \
  --offload-plan /tmp/s10_off2.json --json $R/private_spec_2026-12-04_spec18s10_after_k3.json \
  > $R/private_spec_2026-12-04_spec18s10_after_k3.log 2>&1
echo "after rc=$?"; date -u; uptime
