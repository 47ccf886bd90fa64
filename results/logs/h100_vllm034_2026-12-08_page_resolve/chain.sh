#!/usr/bin/env bash
# Lease plan (serving kit), twenty-eighth session, at .devcalls/commit (branch page-resolve-kernel: main + issue 50's
# one-launch resolve kernel), under dev/gpu/background.sh; ~1000 s of device time left after failed starts, so the
# soak, the 1M dense row and EAGLE's TPOT wait for a later lease:
# A (GPU alone): the host tier's step cost, the served resolve (the kernel) beside the torch ops in one run.
# B: the smoke's serve parts (plain 8000, host tier 8001) beside the resolve kernel's GPU tests and the engine tests
#    (host tier through the kernel; EAGLE, issue 45 item 4, first GPU run; 0.3 of the GPU each now).
# C: the smoke's M3 part beside MiniMax-M3 with the tier and the CPU-offload connector check (issue 45 item 5).
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
gputest() {  # NAME LIMIT pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rf --tb=short -m gpu -s -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
  stamp "$name rc $?: $(tail -1 "$out/$name.log")"
}
stamp "at $COMMIT: A, GPU alone: bench_host_tier"
timeout 300 python3 -m bench.bench_host_tier --contexts 131072 --batches 1 32 --misses 0 4 16 64 \
  > "$out/bench_host_tier.log" 2>&1
stamp "bench_host_tier rc $?"
stamp "B: smoke serve parts (plain 8000, host tier 8001), resolve kernel tests, engine tests"
OUT=$out/smoke PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G > "$out/smoke_serve.out" 2>&1 &
plain=$!
OUT=$out/smoke_tier PORT=8001 PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G --max-num-seqs 64 \
  --num-gpu-blocks-override 4096 --additional-config '{"flash_msa_kv_device_pages": 1024}' > "$out/smoke_tier.out" 2>&1 &
tier=$!
gputest page_resolve_tests 400 tests/test_cute_kernels.py -k page_resolve
gputest engine_tier_eagle 600 tests/test_vllm_engine.py -k "host_tier_on_a_gpu or eagle"
wait $plain; stamp "smoke serve rc $?: $(tail -1 "$out/smoke/serve_smoke-serve.log")"
wait $tier; stamp "smoke tier rc $?: $(tail -1 "$out/smoke_tier/serve_smoke-serve.log")"
stamp "C: smoke m3 part, MiniMax-M3 with the tier, CPU offload connector"
OUT=$out/smoke PARTS=m3 bash dev/gpu/serve_smoke.sh > "$out/smoke_m3.out" 2>&1 &
m3=$!
timeout 600 python3 dev/gpu/kv_connectors.py --out "$out/connectors" --checks offload -- --kv-cache-memory-bytes 4G \
  > "$out/connectors.log" 2>&1 &
connectors=$!
gputest m3_host_tier 600 tests/test_minimax_m3.py -k host_tier
wait $m3; stamp "smoke m3 rc $?: $(tail -1 "$out/smoke/serve_smoke-m3.log")"
wait $connectors; stamp "connectors rc $?"
stamp "done"
