TOK=/root/.cache/cipherlm/models/SmolLM2-135M-Instruct
for i in $(seq $1); do for t in base main; do
  d=/work/main; [ $t = base ] && d=/work/wt/base
  (cd $d && PYTHONPATH=$d flock /tmp/cipherlm-bench.lock /work/main/.venv/bin/python -m bench.serve_api_cpu --tok $TOK --rounds 1 --duration 8 --output-len 128 --clients 2 --variant $t:env.CIPHERLM_BENCH_STEP_MS=4 2>&1 | grep "^| \(run\|---\|$t\)")
done; done
