#!/bin/bash
# eng22-s21: main 0d72770 vs this branch through bench/serve_api_cpu.py (the real API over a model-free core,
# 4 ms step floor, 256 users x 128 tokens), order main, branch, branch, main.
TOK=/work/main/.carry/eng21/tok
run() { (cd $2 && PYTHONPATH=$2 /work/main/.venv/bin/python -m bench.serve_api_cpu --tok $TOK --rounds 1 --duration 8 \
  --output-len 128 --variant "$1:env.CIPHERLM_BENCH_STEP_MS=4" --json /tmp/eng22/ab_$1-$3.json) 2>&1 | grep "^| $1"; }
date -u +%FT%TZ
run main /tmp/eng22/base/tree 1; run branch /work/wt/eng22 1; run branch /work/wt/eng22 2; run main /tmp/eng22/base/tree 2
date -u +%FT%TZ
