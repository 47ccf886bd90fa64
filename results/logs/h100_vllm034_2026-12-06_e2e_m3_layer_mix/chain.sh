#!/usr/bin/env bash
# The seventeenth session's lease (serving kit), in issue order: the serving smoke's serve part at HEAD (issue 44
# item 2); the two-rank engine tests on one GPU (issue 44 item 3: they must skip); issue 45 item 1 at 32K (m3-layer-mix
# built meanwhile; FLASH_MSA bf16 / FP8 index keys / vLLM's M3, started together); issue 46: one decode layer's kernels
# at batch 1; issue 47's prefill A/B; the smoke's M3 part. Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
stamp "building m3-layer-mix in the background"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
stamp "serve smoke at $COMMIT: vllm serve"
OUT=$out/smoke PARTS=serve timeout 400 bash dev/gpu/serve_smoke.sh; stamp "serve part rc $?"
stamp "two-rank engine tests (one GPU: must skip)"
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_engine.py \
  tests/test_server_parallel.py -k "tensor_parallel_2 or data_parallel_2 or replicated_kv_and_index_heads_at_tp2" \
  > "$out/two_rank_tests.log" 2>&1
stamp "two-rank tests rc $?: $(tail -1 "$out/two_rank_tests.log")"
wait $build; stamp "m3-layer-mix built rc $?: $(tail -3 "$out/build_m3mix.log" | tr '\n' ' ')"
stamp "e2e: m3-layer-mix at 32K"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); gib=$((gib / 1024))
if [ "$gib" -gt 100 ]; then only="FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE dense"; kv=24G
else only="FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE"; kv=18G; fi
stamp "GPU memory ${gib} GiB: configurations $only, K/V cache $kv each"
# shellcheck disable=SC2086
timeout 1100 python3 serve/bench_e2e.py /tmp/m3mix --only $only \
  --input-lens 32768 --output-len 64 --num-prompts 8 --concurrency 1 16 --parallel-start --startup-timeout 600 \
  --bench-timeout 200 --out "$out/e2e" -- --kv-cache-memory-bytes $kv > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
stamp "decode layer kernels at batch 1"
for ctx in 8192 32768 131072; do
  PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 120 python3 -m bench.profile_decode_layer --context $ctx --batch 1 \
    --calls 60 > "$out/profile_decode_b1_$ctx.log" 2>&1; stamp "profile $ctx rc $?"
done
PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 200 python3 -m bench.launch_floor > "$out/launch_floor.log" 2>&1
stamp "launch floor rc $?"
stamp "prefill attention A/B: A = main, B = prefill-one-configuration"
OUT=$out/ab bash dev/gpu/ab.sh 3 . .devcalls/oneconfig -- timeout 150 python3 -m bench.bench_prefill_attention \
  --trained "$PWD/runs/trained-selections.pt"
stamp "serve smoke: tiny M3"
OUT=$out/smoke PARTS=m3 M3_TIMEOUT=700 bash dev/gpu/serve_smoke.sh; stamp "m3 part rc $?"
stamp "done"
