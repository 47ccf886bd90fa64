#!/usr/bin/env bash
# The next lease (serving kit), in issue order: the serving smoke's serve part; issue 45: one decode step of
# m3-layer-mix at 32K x 1 profiled on FLASH_MSA and on vLLM's M3 (the cell FLASH_MSA lost, TPOT 1.13x), then the
# end-to-end run at 128K (three servers started together), a probe of M3's MTP draft on both backends; issue 46's cluster-merge candidate: its GPU tests, the split-K sweep beside split + combine; issue 47's prefill A/B; the smoke's M3 part. Under
# dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "building m3-layer-mix in the background"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
wait $build; stamp "m3-layer-mix built rc $?"
for config in "FLASH_MSA:--attention-backend FLASH_MSA" "MINIMAX_M3_SPARSE:--attention-backend FLASH_ATTN"; do
  name=${config%%:*}
  stamp "decode step profile, $name, 32K x 1"
  # shellcheck disable=SC2086  # the flags split
  PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 420 python3 -m bench.profile_served_decode /tmp/m3mix --context 32768 \
    --batch 1 --steps 16 --top 40 -- ${config#*:} --block-size 128 --kv-cache-memory-bytes 8G \
    > "$out/profile_step_$name.log" 2>&1
  stamp "profile $name rc $?: $(grep -m1 'wall per step' "$out/profile_step_$name.log")"
done
stamp "e2e: m3-layer-mix at 128K"
timeout 1100 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE \
  --input-lens 131072 --output-len 64 --num-prompts 4 --concurrency 1 --parallel-start --startup-timeout 600 \
  --bench-timeout 300 --out "$out/e2e" -- --kv-cache-memory-bytes 18G > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
stamp "issue 45 item 4 probe: M3's MTP draft (tiny M3 with --mtp 1) on FLASH_MSA and on vLLM's M3, with and without"
python3 serve/build_m3_model.py /tmp/m3mtp --mtp 1 > "$out/build_m3mtp.log" 2>&1
timeout 900 python3 serve/bench_e2e.py /tmp/m3mtp --only FLASH_MSA MINIMAX_M3_SPARSE --input-lens 2048 --output-len 64 \
  --num-prompts 4 --concurrency 1 --temperature 0 --parallel-start --startup-timeout 500 --bench-timeout 120 \
  --speculative-config '{"method": "minimax_m3_mtp", "num_speculative_tokens": 1}' --out "$out/e2e_mtp" \
  -- --kv-cache-memory-bytes 4G > "$out/e2e_mtp.log" 2>&1
stamp "mtp probe rc $?"
stamp "issue 46 candidate (branch decode-cluster-merge, .devcalls/cluster): its GPU tests, then the split-K sweep"
(cd .devcalls/cluster && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 600 python3 -m pytest -q -p no:cacheprovider \
  tests/test_cute_kernels.py -k "cluster or sparse_attention_kernel_matches" > "$out/cluster_tests.log" 2>&1)
stamp "cluster tests rc $?: $(tail -1 "$out/cluster_tests.log")"
(cd .devcalls/cluster && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 300 python3 -m bench.bench_sparse_attention \
  --sections splits > "$out/cluster_splits.log" 2>&1); stamp "cluster splits rc $?"
stamp "prefill attention A/B: A = main, B = prefill-one-configuration"
OUT=$out/ab bash dev/gpu/ab.sh 3 . .devcalls/oneconfig -- timeout 150 python3 -m bench.bench_prefill_attention \
  --trained "$PWD/runs/trained-selections.pt"
stamp "done"
