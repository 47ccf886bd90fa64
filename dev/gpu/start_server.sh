#!/usr/bin/env bash
# On the GPU machine, after `source dev/gpu/install_vllm.sh` (which installs the plugin next to the staged
# vLLM): build the demo MSA model and start the real `vllm serve --attention-backend FLASH_MSA` in its
# own process session, so it outlives this device call and serves the next calls while the machine
# stays warm. Returns at once; dev/gpu/wait_server.sh waits for /health.
#   PRESET=m3-attention PORT=8000 bash dev/gpu/start_server.sh [more `vllm serve` flags]
# PRESET: default | m3-attention (MiniMax-M3's attention shapes, 136K context); MODEL=DIR serves that checkpoint
# instead (e.g. models/needle-msa, what serve/demo.sh serves). Server log and pid:
# /tmp/gpu-server/serve-$PORT.log, serve-$PORT.pid.
set -euo pipefail
cd "$(dirname "$0")/../.."
port=${PORT:-8000}; preset=${PRESET:-default}
dir=/tmp/gpu-server; mkdir -p "$dir"
model=${MODEL:-/tmp/demo-msa-$preset}
if [ -z "${MODEL:-}" ]; then
  python3 serve/build_demo_model.py "$model" --preset "$preset" > "$dir/build-$preset.log" 2>&1 \
    || { cat "$dir/build-$preset.log"; exit 1; }
fi
max_len=$(python3 -c "import json; print(json.load(open('$model/config.json'))['max_position_embeddings'])")
setsid vllm serve "$model" --attention-backend FLASH_MSA --served-model-name demo-msa \
  --host 127.0.0.1 --port "$port" --max-model-len "$max_len" --gpu-memory-utilization "${GPU_MEM:-0.3}" "$@" \
  > "$dir/serve-$port.log" 2>&1 < /dev/null &
echo $! > "$dir/serve-$port.pid"
echo "started vllm serve $model (max_model_len $max_len) on port $port, pid $(cat "$dir/serve-$port.pid"), log $dir/serve-$port.log"
