#!/usr/bin/env bash
# Serve the demo MSA model with FLASH_MSA on 127.0.0.1 (OpenAI API: /v1/completions,
# /v1/chat/completions): the pass-key model trained with MSA (models/needle-msa, training/README.md) where
# it exists, else the random-weight demo checkpoint (VLLM_MSA_DEMO_DIR, default runs/demo-msa), built on
# first use. VLLM_MSA_DEMO_DIR set: always the random-weight one. Sets up .venv on first use.
#   bash serve/demo.sh [--port 8000] [more `vllm serve` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash serve/setup.sh
if [[ -z ${VLLM_MSA_DEMO_DIR:-} && -f models/needle-msa/config.json ]]; then
  model=models/needle-msa
else
  model=${VLLM_MSA_DEMO_DIR:-runs/demo-msa}
  .venv/bin/python serve/build_demo_model.py "$model"
fi
# The CPU build sizes its KV cache from --kv-cache-memory-bytes; 1 GiB holds ~40 full 8K contexts here.
# glibc's dynamic mmap threshold lets the worker's heap keep the freed per-step temporaries of the
# PyTorch path: under load its RSS grew by ~700 MiB in 2 minutes; with a fixed 128 KiB threshold
# larger blocks go back to the OS on free and RSS stays flat (results/README.md, demo server soak on CPU).
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-131072}
exec .venv/bin/vllm serve "$model" \
  --attention-backend FLASH_MSA \
  --served-model-name demo-msa \
  --host 127.0.0.1 --port 8000 \
  --max-model-len 8192 \
  --kv-cache-memory-bytes 1G \
  "$@"
