#!/bin/bash
. /work/main/.venv/bin/activate
cd /work/wt/pack17
for tree in /tmp/pack17_before /work/wt/pack17; do
  name=$([ $tree = /work/wt/pack17 ] && echo after || echo before)
  uptime; date -u
  (cd $tree && PYTHONPATH=$tree timeout 900 python bench/private_e2e.py --offload-plan /tmp/pack17_off4.json --prompt-tokens 16 --max-tokens 2 --json /work/wt/pack17/bench/results/private_e2e_2026-12-02_pack17_off4_p16_$name.json) > /work/wt/pack17/bench/results/private_e2e_2026-12-02_pack17_off4_p16_$name.log 2>&1
  echo "$name rc=$?"; uptime; date -u
done
uptime; date -u
cd /work/wt/pack17 && PYTHONPATH=/work/wt/pack17 timeout 900 python bench/private_spec.py --k 3 --max-tokens 16 --offload-plan /tmp/pack17_off2.json --json bench/results/private_spec_2026-12-02_pack17_off2.json > bench/results/private_spec_2026-12-02_pack17_off2.log 2>&1
echo "spec rc=$?"; uptime; date -u
