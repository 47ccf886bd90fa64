#!/usr/bin/env bash
# The sixteenth session's lease (serving kit): the serving smoke's serve part, the kernel tests, the smoke's M3 part, then the peer table at the same
# shapes on the serving kit (vLLM 0.34, Triton 3.8) and on the kernel kit (the image's torch 2.11 and Triton 3.6,
# vLLM 0.34's M3 op files staged). Run under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
stamp "serve smoke at $COMMIT: vllm serve"
OUT=$out/smoke PARTS=serve timeout 600 bash dev/gpu/serve_smoke.sh; stamp "serve part rc $?"
stamp "kernel tests"
OUT=$out bash dev/gpu/kernel_checks.sh tests; stamp "kernel tests rc $?"
stamp "serve smoke: tiny M3"
OUT=$out/smoke PARTS=m3 M3_TIMEOUT=700 bash dev/gpu/serve_smoke.sh; stamp "m3 part rc $?"
shapes=(--contexts 8192 131072 --decode-batches 1 32 --index-keys bf16)
stamp "peers, serving kit"
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 -m bench.bench_vs_vllm_m3 "${shapes[@]}" --out "$out/peers_serving_kit" \
  > "$out/peers_serving_kit.log" 2>&1
stamp "peers serving kit rc $?"
# The kernel kit: CuTeDSL and TVM-FFI (the serving kit's own copies, linked) on the image's torch and Triton.
mkdir -p /tmp/site-k && ln -sfn /tmp/site/nvidia_cutlass_dsl /tmp/site-k/ && ln -sfn /tmp/site/tvm_ffi /tmp/site-k/
stamp "peers, kernel kit"
env PYTHONPATH="$PWD:$PWD/kernels:/tmp/site-k:/tmp/site-k/nvidia_cutlass_dsl/dsl_packages" \
  timeout 300 python3 -m bench.bench_vs_vllm_m3 "${shapes[@]}" --out "$out/peers_kernel_kit" \
  > "$out/peers_kernel_kit.log" 2>&1
stamp "peers kernel kit rc $?"
stamp "done"
