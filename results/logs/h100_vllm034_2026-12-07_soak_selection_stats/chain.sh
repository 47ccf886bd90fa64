#!/usr/bin/env bash
# Lease plan (serving kit) at main (.devcalls/commit), under dev/gpu/background.sh:
# 1. serving smoke at HEAD: serve part plain (8000) and with the host tier (8001) side by side, then the m3 part;
#    beside them the host tier's GPU tests never run on a GPU (device-memory refusal, M3 with the tier) and the
#    page-copy / engine tier tests; the soak's server (8002, m3-attention) starts meanwhile.
# 2. issue 45 item 3: locust soak, 64 users x 600 s, 1K and 32K prompts, against FLASH_MSA (m3-attention).
# First, beside the servers' start: the selection-stats kernel's GPU test (served in every step's metrics);
# after the soak its benchmark (GPU alone).
# 3. issue 45 item 5: KV connectors. 4. issue 45 item 2: the 1M prompt's dense row.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
(time python3 serve/build_m3_model.py /tmp/m3a1m --preset m3-attention-1m) > "$out/build_m3a1m.log" 2>&1 &
build=$!
stamp "at $COMMIT: smoke serve parts (plain 8000, host tier 8001), soak server 8002 starting"
OUT=$out/smoke PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G > "$out/smoke_serve.out" 2>&1 &
plain=$!
OUT=$out/smoke_tier PORT=8001 PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G --max-num-seqs 64 \
  --num-gpu-blocks-override 4096 --additional-config '{"flash_msa_kv_device_pages": 1024}' > "$out/smoke_tier.out" 2>&1 &
tier=$!
PRESET=m3-attention PORT=8002 GPU_MEM=0.35 bash dev/gpu/start_server.sh > "$out/soak_server_start.log" 2>&1
gputest() {  # NAME LIMIT pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rf --tb=short -m gpu -s -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
  stamp "$name rc $?: $(tail -1 "$out/$name.log")"
}
gputest selection_stats_tests 300 tests/test_cute_kernels.py -k selection_stats
gputest page_copy_tests 300 tests/test_cute_kernels.py -k page_copy
gputest device_tier_refusal 300 tests/test_plugin.py -k device_tier_past
wait $plain; stamp "smoke serve rc $?: $(tail -1 "$out/smoke/serve_smoke-serve.log")"
wait $tier; stamp "smoke tier rc $?: $(tail -1 "$out/smoke_tier/serve_smoke-serve.log")"
PORT=8002 TIMEOUT=300 bash dev/gpu/wait_server.sh > "$out/soak_server_wait.log" 2>&1
stamp "soak server: $(head -1 "$out/soak_server_wait.log")"
stamp "soak: 64 users x 600 s (the tests below share the GPU for their minutes)"
OUT=$out PORT=8002 USERS=64 RUN_TIME=600 PROMPT_TOKENS=1024 LONG_PROMPT_TOKENS=32768 bash dev/gpu/load_gpu.sh \
  > "$out/soak.out" 2>&1 &
soak=$!
gputest host_tier_engine 500 tests/test_vllm_engine.py -k host_tier
gputest m3_host_tier 600 tests/test_minimax_m3.py -k host_tier
OUT=$out/smoke PARTS=m3 bash dev/gpu/serve_smoke.sh > "$out/smoke_m3.out" 2>&1
stamp "smoke m3 rc $?: $(tail -1 "$out/smoke/serve_smoke-m3.log")"
wait $soak; stamp "soak rc $?: $(tail -3 "$out/soak.out" | tr '\n' ' ')"
cp /tmp/gpu-server/serve-8002.log "$out/soak_server.log"
grep -E "Traceback| ERROR [0-9]" "$out/soak_server.log" | head -5 > "$out/soak_server_errors.log"
stamp "soak server errors: $(wc -l < "$out/soak_server_errors.log")"
kill "$(cat /tmp/gpu-server/serve-8002.pid)"; sleep 10
stamp "bench_selection_stats (GPU alone)"
timeout 200 python3 -m bench.bench_selection_stats > "$out/bench_selection_stats.log" 2>&1
stamp "bench_selection_stats rc $?"
stamp "issue 45 item 5: KV connectors"
timeout 900 python3 dev/gpu/kv_connectors.py --out "$out/connectors" > "$out/connectors.log" 2>&1
stamp "connectors rc $?"
wait $build; stamp "m3a1m built rc $?"
stamp "issue 45 item 2: the 1M prompt's dense row"
timeout 1200 python3 serve/bench_e2e.py /tmp/m3a1m --only dense --input-lens 1048000 --output-len 16 --num-prompts 1 \
  --concurrency 1 --warmups 0 --greedy-tokens 16 --bench-timeout 900 --startup-timeout 600 --out "$out/e2e1m" \
  -- --kv-cache-memory-bytes 30G > "$out/e2e1m.log" 2>&1
stamp "dense 1M rc $?"
stamp "done"
