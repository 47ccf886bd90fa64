#!/usr/bin/env bash
# Train the pass-key MSA model (training/train_needle.py, preset h200) on the GPU machine with the image's
# python3 and torch (not the vLLM kit). From the repository root there, safe to leave running in the
# background for the rest of a device lease:
#   setsid bash dev/gpu/train_needle.sh runs/demo-msa [train_needle flags] > /dev/null 2>&1 < /dev/null &
# The argument: a checkpoint directory with the demo tokenizer (python serve/build_demo_model.py runs/demo-msa).
# Writes /tmp/needle_out: train.log, state.pt, model/ (the checkpoint), summary.json, exit_code (0 done,
# 3 stopped by the time budget: the same command continues). BUDGET: seconds (default 450). Flags after the
# directory go to training/train_needle.py, e.g. issue 49's data: --chat-share 0.5 --filler grammar --distractors 3.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
tokenizer=${1:?usage: dev/gpu/train_needle.sh TOKENIZER_DIR [train_needle flags]}
shift
out=/tmp/needle_out
mkdir -p "$out"
PYTHONPATH="$PWD:$PWD/kernels" python3 -m training.train_needle --tokenizer "$tokenizer" --out "$out" \
  --preset h200 --time-budget-s "${BUDGET:-450}" --fit-time "$@" >> "$out/train.log" 2>&1
echo $? > "$out/exit_code"
