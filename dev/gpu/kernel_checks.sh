#!/usr/bin/env bash
# On the GPU machine, after sourcing a kit's install (dev/gpu/install_vllm.sh, or .devkit/install.sh for the
# kernels alone), with this tree's kernels and benchmarks first on PYTHONPATH: run the kernel checks and
# benchmarks named, each with its own time limit and one summary line here; their logs (and the peer table's
# report and plots) come back as $OUT/kernel_checks.tgz (a device call brings back few files: one archive),
# packed again after each check, so a call cut off at its limit still brings back the checks that finished.
#   bash dev/gpu/kernel_checks.sh [tests] [writes] [memcheck] [racecheck] [topk] [sparse] [index] [prefill]
#     [prefill_1m] [prefill_attention] [peers] [long] [host] [index_write] [profile_prefill]
# (none named: tests, then writes+memcheck: up to 680 s, more than one device call: run it under dev/gpu/background.sh).
# The kernel tests run alone: beside the sanitizers they ran past their limit (H100, 2026-12-05).
# Checks joined by '+' run at the same time (tests+writes+memcheck: correctness only, never benchmarks, whose
# times another process on the GPU would skew); the group takes as long as its slowest check.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
: "${OUT:?run on the GPU machine: \$OUT is the folder a device call brings back}"
out=/tmp/kernel_checks
rm -rf "$out" && mkdir -p "$out"
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
sanitize=(compute-sanitizer --report-api-errors no)
# The kernel tests in 8 processes (pytest-xdist, on the GPU image) where it imports: most of their time is compiling
# kernel variants on the host (1-4 s each), which the machine's 16 cores do side by side; one GPU runs them all.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
# The trained pass-key model's selections (python -m training.trained_selections models/needle-msa, carried):
# prefill_attention adds them to its problems.
trained=()
[ -f runs/trained-selections.pt ] && trained=(--trained runs/trained-selections.pt)

run() {  # NAME SECONDS COMMAND...: the command's output in $out/NAME.log, then its last summary line
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $(grep -E 'passed|failed|ERROR SUMMARY|^total|report:' "$out/$name.log" | tail -1)"
}

check() {  # NAME: run one named check
  case $1 in
    tests) run pytest_cute 480 python3 -m pytest -q -rf --tb=short "${workers[@]}" tests/test_cute_kernels.py ;;
    # FP8 K/V pages written by vLLM's cache op (the serving kit: the plugin imports vLLM)
    writes) run pytest_fp8_kv_writes 150 python3 -m pytest -q -rf --tb=short tests/test_plugin.py -k fp8_kv_pages_written ;;
    memcheck) run sanitize_memcheck 200 "${sanitize[@]}" --tool memcheck python3 -m bench.sanitize ;;
    racecheck) run sanitize_racecheck 300 "${sanitize[@]}" --tool racecheck python3 -m bench.sanitize ;;
    topk) run bench_topk 60 python3 -m bench.bench_topk ;;
    # decode sections (the prefill attention: prefill_attention, and peers)
    sparse) run bench_sparse_attention 300 python3 -m bench.bench_sparse_attention --sections decode fp8_kv \
      splits ;;
    index) run bench_index_scores 150 python3 -m bench.bench_index_scores ;;
    prefill) run bench_prefill_index 200 python3 -m bench.bench_prefill_index ;;
    prefill_1m) run bench_prefill_index_1m 200 python3 -m bench.bench_prefill_index --contexts 1048576 \
      --new-tokens 16384 ;;
    prefill_attention) run bench_prefill_attention 300 python3 -m bench.bench_prefill_attention "${trained[@]}" ;;
    peers) run bench_vs_vllm_m3 300 python3 -m bench.bench_vs_vllm_m3 --out "$out/vs_vllm_m3" ;;
    long) run bench_long_decode 240 python3 -m bench.bench_vs_vllm_m3 --contexts 131072 262144 524288 \
      1048576 --decode-batches 1 --prefill-contexts --out "$out/long_decode" ;;
    host) run bench_host_overhead 120 python3 -m bench.bench_host_overhead ;;
    index_write) run bench_index_key_write 120 python3 -m bench.bench_index_key_write ;;
    # Nsight Compute on the prefill index-score kernel at 32K: bench_prefill_index.py times the bf16 kernel with
    # 6 launches, then the FP8 one: --launch-skip 5 profiles the last bf16 launch and the first FP8 one.
    profile_prefill) run ncu_prefill_index 300 ncu --kernel-name regex:PrefillIndexScore --launch-skip 5 \
      --launch-count 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section InstructionStats python3 -m bench.bench_prefill_index --contexts 32768 ;;
    *) echo "unknown check '$1' (tests writes memcheck racecheck topk sparse index prefill prefill_1m prefill_attention peers" \
      "long host index_write profile_prefill)" >&2; return 2 ;;
  esac
}

[ $# -gt 0 ] || set -- tests writes+memcheck
for group in "$@"; do
  IFS=+ read -ra together <<< "$group"
  for name in "${together[@]}"; do check "$name" & done
  wait
  tar czf "$OUT/kernel_checks.tgz" -C /tmp kernel_checks
done
