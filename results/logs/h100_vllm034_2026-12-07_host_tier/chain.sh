#!/usr/bin/env bash
# Lease plan (serving kit) at branch host-tier (.devcalls/commit): the serving smoke (vllm_msa/ changed: issue 50's
# host tier), the smoke's serve part again with the host tier on, the page-copy kernel and host-tier GPU tests; then
# issue 45 in order: item 1's losing cell (128K x 1 TPOT) profiled on both servers (issue 46 too), item 2's
# 1M-token prompt, item 5's KV connectors, item 4's n-gram acceptance and TPOT. Under dev/gpu/background.sh.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "at $COMMIT: serving smoke's serve part, and the same with the host tier (1024 device pages a layer, 64 requests, 4096 pages), two servers at once"
OUT=$out/smoke PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G > "$out/smoke_serve.out" 2>&1 &
plain=$!
PORT=8001 OUT=$out/smoke_tier PARTS=serve bash dev/gpu/serve_smoke.sh --kv-cache-memory-bytes 8G --max-num-seqs 64 \
  --num-gpu-blocks-override 4096 --additional-config '{"flash_msa_kv_device_pages": 1024}' > "$out/smoke_tier.out" 2>&1
stamp "smoke tier rc $?: $(tail -1 "$out/smoke_tier/serve_smoke-serve.log")"
wait $plain; stamp "smoke serve rc $?: $(tail -1 "$out/smoke/serve_smoke-serve.log")"
stamp "smoke m3 part beside the page-copy kernel's GPU tests"
timeout 300 python3 -m pytest -q -rf --tb=short -m gpu -p no:cacheprovider tests/test_cute_kernels.py -k page_copy \
  > "$out/page_copy_tests.log" 2>&1 &
tests=$!
OUT=$out/smoke PARTS=m3 bash dev/gpu/serve_smoke.sh > "$out/smoke_m3.out" 2>&1
stamp "smoke m3 rc $?: $(tail -1 "$out/smoke/serve_smoke-m3.log")"
wait $tests; stamp "page copy tests rc $?: $(tail -1 "$out/page_copy_tests.log")"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
stamp "host tier engine test (beside the m3-layer-mix build)"
timeout 500 python3 -m pytest -q -rf --tb=short -m gpu -s -p no:cacheprovider tests/test_vllm_engine.py -k host_tier \
  > "$out/host_tier_engine.log" 2>&1
stamp "host tier engine test rc $?: $(grep -E 'host tier on the GPU' "$out/host_tier_engine.log") $(tail -1 "$out/host_tier_engine.log")"
wait $build; stamp "m3mix built rc $?"
python3 serve/build_m3_model.py /tmp/m3a1m --preset m3-attention-1m > "$out/build_m3a1m.log" 2>&1 &
build=$!
for config in FLASH_MSA:--attention-backend=FLASH_MSA MINIMAX_M3_SPARSE:--attention-backend=FLASH_ATTN; do
  name=${config%%:*}
  stamp "served decode step profile, $name, 128K x 1"
  timeout 420 python3 -m bench.profile_served_decode /tmp/m3mix --context 131072 --batch 1 --steps 16 --top 40 \
    --layer-marker fusedMiniMaxM3RowGroup -- "${config#*:}" --block-size 128 --kv-cache-memory-bytes 20G \
    > "$out/profile_step_$name.log" 2>&1
  stamp "profile $name rc $?: $(grep -m1 'wall per step' "$out/profile_step_$name.log")"
done
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
