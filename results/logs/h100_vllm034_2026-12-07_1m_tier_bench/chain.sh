#!/usr/bin/env bash
# Lease plan (serving kit) at main (.devcalls/commit): the serving smoke at HEAD (both parts side by side), the
# page-copy and host-tier GPU tests rerun after their fixes, bench.bench_host_tier (issue 50: what the tier adds to a
# layer), then issue 45 in order: item 2's 1M-token prompt, item 5's KV connectors, item 4's n-gram. Under
# dev/gpu/background.sh.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
(time python3 serve/build_m3_model.py /tmp/m3a1m --preset m3-attention-1m) > "$out/build_m3a1m.log" 2>&1 &
build=$!
stamp "at $COMMIT: serving smoke, serve and m3 parts side by side, the page-copy GPU tests beside them"
OUT=$out/smoke PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G > "$out/smoke_serve.out" 2>&1 &
plain=$!
timeout 300 python3 -m pytest -q -rf --tb=short -m gpu -p no:cacheprovider tests/test_cute_kernels.py -k page_copy \
  > "$out/page_copy_tests.log" 2>&1
stamp "page copy tests rc $?: $(tail -1 "$out/page_copy_tests.log")"
OUT=$out/smoke PARTS=m3 bash dev/gpu/serve_smoke.sh > "$out/smoke_m3.out" 2>&1
stamp "smoke m3 rc $?: $(tail -1 "$out/smoke/serve_smoke-m3.log")"
wait $plain; stamp "smoke serve rc $?: $(tail -1 "$out/smoke/serve_smoke-serve.log")"
stamp "host tier engine test"
timeout 500 python3 -m pytest -q -rf --tb=short -m gpu -s -p no:cacheprovider tests/test_vllm_engine.py -k host_tier \
  > "$out/host_tier_engine.log" 2>&1
stamp "host tier engine test rc $?: $(grep -E 'host tier on the GPU' "$out/host_tier_engine.log") $(tail -1 "$out/host_tier_engine.log")"
stamp "bench_host_tier"
timeout 300 python3 -m bench.bench_host_tier --contexts 131072 --batches 1 32 --misses 0 4 16 64 \
  > "$out/bench_host_tier.log" 2>&1
stamp "bench_host_tier rc $?"
wait $build; stamp "m3a1m built rc $?"
e2e() {  # NAME TIMEOUT MODEL bench_e2e args...: one server at a time
  local name=$1 limit=$2 model=$3; shift 3
  timeout "$limit" python3 serve/bench_e2e.py "$model" --startup-timeout 600 --out "$out/$name" "$@" \
    > "$out/$name.log" 2>&1
  stamp "$name rc $?"
}
stamp "m3-attention-1m: a 1,048,000-token prompt, FLASH_MSA, vLLM's M3, dense; prefix cache off"
e2e e2e1m 1000 /tmp/m3a1m --only FLASH_MSA MINIMAX_M3_SPARSE dense --input-lens 8192 1048000 --output-len 16 \
  --num-prompts 1 --concurrency 1 --warmups 0 --greedy-tokens 16 --bench-timeout 600 -- --kv-cache-memory-bytes 30G
stamp "issue 45 item 5: KV connectors (ExampleConnector, CPU offload) against a server without one"
timeout 900 python3 dev/gpu/kv_connectors.py --out "$out/connectors" > "$out/connectors.log" 2>&1
stamp "connectors rc $?"
stamp "done"
