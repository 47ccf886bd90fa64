#!/usr/bin/env bash
# Lease plan (serving kit) at main (.devcalls/commit), issue order: issue 45's 128K cells (FLASH_MSA against vLLM's
# M3, greedy tokens compared), its n-gram GPU test (beside the m3-layer-mix build), the 1M-token prompt against
# vLLM's M3, KV connectors; issue 51's CUDA-graph layer time against main before the bound launches (.devcalls/main
# = fb0baa1); the index-key write bench; issue 45's dense rows and FP8-index 128K row; the soak. vllm_msa/ is
# unchanged since the smoke that passed at 15cc837. Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "at $COMMIT: m3-layer-mix build beside the n-gram GPU engine test (issue 45 item 4)"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
timeout 600 python3 -m pytest -q -rf --tb=short -m gpu tests/test_vllm_engine.py -k ngram > "$out/ngram.log" 2>&1
stamp "ngram rc $?: $(tail -1 "$out/ngram.log")"
wait $build; stamp "m3-layer-mix built rc $?"
e2e() {  # NAME TIMEOUT MODEL bench_e2e args...: one server at a time
  local name=$1 limit=$2 model=$3; shift 3
  timeout "$limit" python3 serve/bench_e2e.py "$model" --startup-timeout 600 --out "$out/$name" "$@" \
    > "$out/$name.log" 2>&1
  stamp "$name rc $?"
}
stamp "e2e 128K: FLASH_MSA, then vLLM's M3, concurrency 1 and 16"
e2e e2e128k 1000 /tmp/m3mix --only FLASH_MSA MINIMAX_M3_SPARSE --input-lens 131072 --concurrency 1 16 \
  --output-len 64 --num-prompts 4 --bench-timeout 400 --greedy-tokens 16 -- --kv-cache-memory-bytes 40G
stamp "m3-attention-1m: a 1,048,000-token prompt, FLASH_MSA then vLLM's M3, prefix cache off"
python3 serve/build_m3_model.py /tmp/m3a1m --preset m3-attention-1m > "$out/build_m3a1m.log" 2>&1
e2e e2e1m 1500 /tmp/m3a1m --only FLASH_MSA MINIMAX_M3_SPARSE --input-lens 8192 1048000 --output-len 16 \
  --num-prompts 1 --concurrency 1 --warmups 0 --greedy-tokens 16 --bench-timeout 900 -- --kv-cache-memory-bytes 30G
stamp "issue 45 item 5: KV connectors (ExampleConnector, CPU offload) against a server without one"
timeout 1200 python3 dev/gpu/kv_connectors.py --out "$out/connectors" > "$out/connectors.log" 2>&1
stamp "connectors rc $?"
stamp "CUDA-graph layer time: main before the bound launches (A) against $COMMIT (B), 2 runs each, alternating"
OUT=$out/graph timeout 500 bash dev/gpu/ab.sh 2 .devcalls/main . -- python3 -m bench.bench_vs_vllm_m3 \
  --contexts 8192 131072 --decode-batches 1 32 --prefill-contexts --index-keys bf16
stamp "graph rc $?"
stamp "index-key write bench, its timed calls rotating over 10 sets of keys (out of L2)"
OUT=$out/kc_write timeout 200 bash dev/gpu/kernel_checks.sh index_write; stamp "index_write rc $?"
stamp "e2e dense at 32K and 128K; FP8 index keys at 128K"
e2e e2e_dense 900 /tmp/m3mix --only dense --input-lens 32768 131072 --concurrency 1 16 --output-len 64 \
  --num-prompts 4 --bench-timeout 400 --greedy-tokens 16 -- --kv-cache-memory-bytes 40G
e2e e2e128k_fp8 600 /tmp/m3mix --only FLASH_MSA-fp8-index --input-lens 131072 --concurrency 1 16 --output-len 64 \
  --num-prompts 4 --bench-timeout 400 --greedy-tokens 16 -- --kv-cache-memory-bytes 40G
stamp "done"
