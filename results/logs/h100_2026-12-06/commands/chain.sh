#!/usr/bin/env bash
# One lease: kernel tests on HEAD (step plan + one-configuration prefill attention), host time of a layer call
# before (224532c, .devcalls/base) and after, alternating, then the prefill attention benchmark and the sanitizers.
export OUT=/tmp/lease
mkdir -p "$OUT" runs
gunzip -c .devcalls/trained-selections.pt.gz > runs/trained-selections.pt
cp .devcalls/head.txt "$OUT/"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
stamp() { echo "== $(date +%T) $*"; }
stamp tests; bash dev/gpu/kernel_checks.sh tests; cp -r /tmp/kernel_checks "$OUT/tests"
stamp host
for i in 1 2; do
  (cd .devcalls/base && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 150 python3 -m bench.bench_host_overhead --calls 1000 --top 10) > "$OUT/host_base_$i.log" 2>&1
  PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 150 python3 -m bench.bench_host_overhead --calls 1000 --top 10 > "$OUT/host_new_$i.log" 2>&1
  grep -h "^| \(decode\|prefill\)" "$OUT/host_base_$i.log" "$OUT/host_new_$i.log"
done
stamp prefill_attention; bash dev/gpu/kernel_checks.sh prefill_attention; cp -r /tmp/kernel_checks "$OUT/bench"
stamp sanitizers; bash dev/gpu/kernel_checks.sh memcheck+racecheck; cp -r /tmp/kernel_checks "$OUT/sanitize"
stamp "done"
