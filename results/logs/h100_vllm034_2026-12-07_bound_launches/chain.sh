#!/usr/bin/env bash
# This lease (serving kit), from branch index-key-write's tree (.devcalls/commit; it holds step-launches' two commits;
# .devcalls/main = main's tree at fb0baa1). Device time is short (~1000 s after the kit): the kernel tests beside
# the serving smoke (correctness only: no timing while both run; the smoke's server takes 0.3 of the GPU), then on a
# quiet GPU issue 51's host time against main and the index-key write bench, then issue 45's end to end (the
# FP8-index row at 32K, greedy tokens compared; the 128K peers). Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out" "$out/kc_tests" "$out/kc_write"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "building m3-layer-mix, the kernel tests and the serving smoke (both parts) at $COMMIT, side by side"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
(OUT=$out/kc_tests timeout 600 bash dev/gpu/kernel_checks.sh tests > "$out/kernel_tests.log" 2>&1) &
tests=$!
OUT=$out/smoke M3_TIMEOUT=700 timeout 1000 bash dev/gpu/serve_smoke.sh; stamp "smoke rc $?"
wait $tests; stamp "kernel tests rc $?: $(tail -1 "$out/kernel_tests.log")"
wait $build; stamp "m3-layer-mix built rc $?"
stamp "index-key write bench"
OUT=$out/kc_write timeout 200 bash dev/gpu/kernel_checks.sh index_write; stamp "index_write rc $?"
stamp "host time of an eager layer call: main (A) against $COMMIT (B), 2 runs each, alternating"
OUT=$out/host timeout 400 bash dev/gpu/ab.sh 2 .devcalls/main . -- python3 -m bench.bench_host_overhead --calls 2000 --top 12
stamp "host rc $?"
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
stamp "e2e: m3-layer-mix at 32K, FP8 index keys beside bf16, concurrency 1 and 16"
timeout 900 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA FLASH_MSA-fp8-index \
  --input-lens 32768 --output-len 64 --num-prompts 8 --concurrency 1 16 --parallel-start --startup-timeout 600 \
  --bench-timeout 200 --greedy-tokens 16 --out "$out/e2e32k" -- --kv-cache-memory-bytes 18G > "$out/e2e32k.log" 2>&1
stamp "e2e 32K rc $?"
stamp "e2e: m3-layer-mix at 128K, concurrency 1: FLASH_MSA, vLLM's M3, dense, one server at a time"
timeout 1500 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA MINIMAX_M3_SPARSE dense \
  --input-lens 131072 --output-len 64 --num-prompts 4 --concurrency 1 --startup-timeout 600 \
  --bench-timeout 400 --greedy-tokens 16 --out "$out/e2e128k" -- --kv-cache-memory-bytes 18G > "$out/e2e128k.log" 2>&1
stamp "e2e 128K rc $?"
stamp "done"
