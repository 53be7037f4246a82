# main 41a1006 (+ only the CoreSpec.parts seam and this bench, so the stub core can run) vs this branch, the
# stub core at 4 ms steps, 256 users x 128 tokens, alternating (main, branch, branch, main); 2026-12-07 00:33 UTC
run() { # tree label
  (cd $1 && PYTHONPATH=$1 /work/main/.venv/bin/python -m bench.serve_api_cpu --tok /tmp/eng21/tok --rounds 1 --duration 8 --output-len 128 --variant $2:env.CIPHERLM_BENCH_STEP_MS=4 --json /tmp/eng21/ab_$2.json 2>&1 | grep "^| $2")
}
run /tmp/eng21/base main-r1; run /work/wt/eng21 branch-r1; run /work/wt/eng21 branch-r2; run /tmp/eng21/base main-r2
