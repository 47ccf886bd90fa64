#!/usr/bin/env bash
# This session's short lease (kernel kit: CuTeDSL + TVM-FFI on the image's torch; ~600 s of device time left after
# failed starts), from branch index-key-write's tree (.devcalls/commit; step-launches' two commits under it;
# .devcalls/main = main's tree at b81d5f0): the index-key write bench (no vLLM column on this kit), the kernel tests,
# issue 51's host time against main. Under dev/gpu/background.sh; logs in /tmp/lease.
set -uo pipefail
out=/tmp/lease; mkdir -p "$out" "$out/kc_write" "$out/kc_tests"
stamp() { echo "[chain $(date +%T)] $*"; }
export COMMIT=${COMMIT:-$(cat .devcalls/commit)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp "index-key write bench at $COMMIT"
OUT=$out/kc_write timeout 150 bash dev/gpu/kernel_checks.sh index_write; stamp "index_write rc $?"
stamp "kernel tests at $COMMIT"
# pytest straight into /tmp/lease (not through kernel_checks.sh, which packs a check's log only once it ends): a run
# the device time cuts still comes back with the tests it got through.
workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-} timeout 200 python3 -m pytest -q -rf --tb=short "${workers[@]}" \
  tests/test_cute_kernels.py -k "index_key_write or fp8_index" > "$out/pytest_write.log" 2>&1
stamp "index-key write tests rc $?: $(tail -1 "$out/pytest_write.log")"
PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-} timeout 480 python3 -m pytest -q -rf --tb=short "${workers[@]}" \
  tests/test_cute_kernels.py > "$out/pytest_cute.log" 2>&1
stamp "kernel tests rc $?: $(tail -1 "$out/pytest_cute.log")"
stamp "host time of an eager layer call: main (A) against $COMMIT (B), 2 runs each, alternating"
OUT=$out/host timeout 300 bash dev/gpu/ab.sh 2 .devcalls/main . -- python3 -m bench.bench_host_overhead --calls 2000 --top 12
stamp "host rc $?"
stamp "done"
