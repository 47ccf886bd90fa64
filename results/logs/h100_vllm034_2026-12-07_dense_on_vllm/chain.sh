#!/usr/bin/env bash
# The next lease (serving kit), run from branch dense-on-vllm-backend's tree (check it out here first; .devcalls/commit
# = its commit; .devcalls/cluster = branch decode-cluster-merge's tree, `git archive decode-cluster-merge kernels bench
# tests vllm_msa serve training pyproject.toml`): the serving smoke, both parts, on the branch (dense layers on vLLM's
# FlashAttention backend; it holds main's change of the index-key cache view too), issue 46's cluster candidate on
# the GPU (its launch fixed), between issue 45's end-to-end runs at 32K and at 128K. Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "building m3-layer-mix in the background"
(time python3 serve/build_m3_model.py /tmp/m3mix --preset m3-layer-mix) > "$out/build_m3mix.log" 2>&1 &
build=$!
stamp "serve smoke at $COMMIT, both parts"
OUT=$out/smoke M3_TIMEOUT=700 timeout 1200 bash dev/gpu/serve_smoke.sh; stamp "smoke rc $?"
grep -h "dense layers" /tmp/gpu-server/serve-*.log "$out"/smoke/*.log 2>/dev/null | head -3 > "$out/dense_layers.log"
wait $build; stamp "m3-layer-mix built rc $?"
export PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH
stamp "e2e: m3-layer-mix at 32K, concurrency 1 and 16"
timeout 1000 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA FLASH_MSA-fp8-index MINIMAX_M3_SPARSE \
  --input-lens 32768 --output-len 64 --num-prompts 8 --concurrency 1 16 --parallel-start --startup-timeout 600 \
  --bench-timeout 200 --out "$out/e2e32k" -- --kv-cache-memory-bytes 18G > "$out/e2e32k.log" 2>&1
stamp "e2e 32K rc $?"
stamp "issue 46 candidate (.devcalls/cluster): GPU tests of the cluster-merged decode attention, then the split sweep"
(cd .devcalls/cluster && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider \
  tests/test_cute_kernels.py -k "cluster or per_token" > "$out/cluster_tests.log" 2>&1)
stamp "cluster tests rc $?: $(tail -1 "$out/cluster_tests.log")"
(cd .devcalls/cluster && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 200 python3 -m bench.bench_sparse_attention \
  --sections splits > "$out/cluster_splits.log" 2>&1)
stamp "cluster splits rc $?"
stamp "e2e: m3-layer-mix at 128K, concurrency 1"
timeout 1100 python3 serve/bench_e2e.py /tmp/m3mix --only FLASH_MSA MINIMAX_M3_SPARSE \
  --input-lens 131072 --output-len 64 --num-prompts 4 --concurrency 1 --parallel-start --startup-timeout 600 \
  --bench-timeout 300 --out "$out/e2e128k" -- --kv-cache-memory-bytes 18G > "$out/e2e128k.log" 2>&1
stamp "e2e 128K rc $?"
stamp "done"
