#!/usr/bin/env bash
# The whole lease's work, in order of need, run by dev/gpu/background.sh (after source dev/gpu/install_vllm.sh):
# each kernel_checks.sh group's logs land in /tmp/lease/NN_name/kernel_checks.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1
L=/tmp/lease
mkdir -p $L
t0=$SECONDS
checks() {  # NAME GROUP...
  local name=$1
  shift
  mkdir -p "$L/$name"
  OUT=$L/$name bash dev/gpu/kernel_checks.sh "$@"
  echo "== $name done at $((SECONDS - t0)) s"
}
nvidia-smi > $L/nvidia-smi.txt 2>&1
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . > /dev/null 2>&1
python3 dev/gpu/check_vllm.py > $L/check_vllm.log 2>&1
echo "== check_vllm rc $? at $((SECONDS - t0)) s"
tail -3 $L/check_vllm.log
checks 01_correctness tests+dense+memcheck+racecheck
grep -hE "^FAILED|ERROR SUMMARY" /tmp/kernel_checks/*.log | head -20
checks 02_decode sparse index host peers
# The trained model's selections travel in a later call than the kit's last part (64 MiB a call): /tmp/trained-selections.pt.
[ -f /tmp/trained-selections.pt ] && mkdir -p runs && cp /tmp/trained-selections.pt runs/
checks 03_prefill sweep_prefill prefill
# Candidates in the peer table: the installed package's served constants set to a candidate's (variant.py), then back.
export PYTHONPATH=$PWD:$PYTHONPATH
V=$L/04_variants
mkdir -p $V
cp /tmp/kernel_checks/sweep_prefill_attention.log $V/
python3 .devcalls/variant.py decode > $V/variant_decode.txt 2>&1
timeout 240 python3 kernels/bench/bench_vs_vllm_m3.py --prefill-contexts --out $V/vs_decode_candidates \
  > $V/bench_vs_vllm_m3_decode_candidates.log 2>&1
echo "== peers decode candidates: rc $? at $((SECONDS - t0)) s"
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . > /dev/null 2>&1
python3 .devcalls/variant.py prefill $V/sweep_prefill_attention.log > $V/variant_prefill.txt 2>&1
cat $V/variant_prefill.txt
timeout 200 python3 kernels/bench/bench_vs_vllm_m3.py --decode-contexts --out $V/vs_prefill_candidate \
  > $V/bench_vs_vllm_m3_prefill_candidate.log 2>&1
echo "== peers prefill candidate: rc $? at $((SECONDS - t0)) s"
checks 05_long long prefill_1m
mkdir -p $L/06_prefill_1m
timeout 300 python3 kernels/bench/bench_vs_vllm_m3.py --decode-contexts --prefill-contexts 262144 1048576 \
  --out $L/06_prefill_1m/vs > $L/06_prefill_1m/bench_vs_vllm_m3_prefill_long.log 2>&1
echo "== peers prefill 256K/1M: rc $? at $((SECONDS - t0)) s"
echo "== chain done at $((SECONDS - t0)) s"
