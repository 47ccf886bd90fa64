#!/usr/bin/env bash
# The next lease (serving kit), run from branch native-kv-layout's tree (check it out here first; .devcalls/mainlayout
# = main's kernels and bench, `git archive main kernels bench`): the GPU checks that branch needs before it can merge,
# then issue 45's runs with it. Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
export PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "building m3-layer-mix in the background"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
stamp "kernel tests on vLLM's K/V layout (the branch's make_case)"
timeout 420 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cute_kernels.py tests/test_dense_path.py \
  > "$out/kernel_tests.log" 2>&1; stamp "kernel tests rc $?: $(tail -1 "$out/kernel_tests.log")"
stamp "serve smoke at $COMMIT (both parts: the M3 part runs vLLM's fused insert into FLASH_MSA's caches)"
OUT=$out/smoke M3_TIMEOUT=700 timeout 1200 bash dev/gpu/serve_smoke.sh; stamp "smoke rc $?"
stamp "A/B: A = main's layout (planes), B = vLLM's layout (the branch): decode and prefill attention"
OUT=$out/ab_decode bash dev/gpu/ab.sh 3 .devcalls/mainlayout . -- timeout 120 python3 -m bench.bench_sparse_attention \
  --sections decode fp8_kv
OUT=$out/ab_prefill bash dev/gpu/ab.sh 3 .devcalls/mainlayout . -- timeout 150 python3 -m bench.bench_prefill_attention \
  --trained "$PWD/runs/trained-selections.pt"
wait $build; stamp "m3-layer-mix built rc $?"
for config in "FLASH_MSA:--attention-backend FLASH_MSA" "MINIMAX_M3_SPARSE:--attention-backend FLASH_ATTN"; do
  name=${config%%:*}
  # shellcheck disable=SC2086  # the flags split
  timeout 420 python3 -m bench.profile_served_decode /tmp/m3mix --context 32768 --batch 1 --steps 16 --top 40 \
    --layer-marker fusedMiniMaxM3RowGroup -- ${config#*:} --block-size 128 --kv-cache-memory-bytes 8G \
    > "$out/profile_step_$name.log" 2>&1
  stamp "profile $name rc $?: $(grep -m1 'wall per step' "$out/profile_step_$name.log") / $(grep -m1 'layer period' "$out/profile_step_$name.log")"
done
stamp "e2e: m3-layer-mix at 32K, concurrency 1 (the losing cell)"
timeout 900 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA MINIMAX_M3_SPARSE --input-lens 32768 \
  --output-len 64 --num-prompts 8 --concurrency 1 --parallel-start --startup-timeout 600 --bench-timeout 200 \
  --out "$out/e2e32k" -- --kv-cache-memory-bytes 18G > "$out/e2e32k.log" 2>&1; stamp "e2e 32K rc $?"
stamp "e2e: m3-layer-mix at 128K"
timeout 1100 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE \
  --input-lens 131072 --output-len 64 --num-prompts 4 --concurrency 1 --parallel-start --startup-timeout 600 \
  --bench-timeout 300 --out "$out/e2e128k" -- --kv-cache-memory-bytes 18G > "$out/e2e128k.log" 2>&1
stamp "e2e 128K rc $?"
stamp "done"
