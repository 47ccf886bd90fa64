#!/usr/bin/env bash
# host time A/B on one GPU: dfecf5c (old: .devcalls/old = `git archive dfecf5c kernels bench`) vs HEAD, alternating
k=/tmp/site-k:/tmp/site-k/nvidia_cutlass_dsl/dsl_packages
for i in 1 2; do
  (cd .devcalls/old && env PYTHONPATH="$PWD:$PWD/kernels:$k" timeout 40 python3 -m bench.bench_host_overhead --calls 2000 --top 6 > "$OUT/old_run$i.log" 2>&1)
  env PYTHONPATH="$PWD:$PWD/kernels:$k" timeout 40 python3 -m bench.bench_host_overhead --calls 2000 --top 6 > "$OUT/new_run$i.log" 2>&1
done
grep -h "decode batch\|prefill chunk" "$OUT"/*_run*.log | grep "^| " | grep -v cProfile
