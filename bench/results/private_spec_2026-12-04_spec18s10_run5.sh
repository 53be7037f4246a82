#!/bin/bash
# issue 18 item 2 (spec18-s10), fifth run: the final code, k = 7, 24 tokens (three verify steps), same plan.
. /work/main/.venv/bin/activate
R=/work/wt/spec18-s10/bench/results
cd /work/wt/spec18-s10
date -u; uptime
PYTHONPATH=$PWD timeout 900 python bench/private_spec.py --k 7 --max-tokens 24 --offload-plan /tmp/s10_off2.json \
  --json $R/private_spec_2026-12-04_spec18s10_final_k7_t24.json > $R/private_spec_2026-12-04_spec18s10_final_k7_t24.log 2>&1
echo "final k=7 t=24 rc=$?"; date -u; uptime
