#!/usr/bin/env bash
# On the GPU machine, against the server of dev/gpu/start_server.sh (PORT, default 8000): the
# locust soak (loadtests/run_load.py --profile soak: streaming and non-streaming completions and
# chats, long prompts, client cancellations, intended bad requests) with USERS concurrent users
# (default 32) for RUN_TIME seconds (default 300), the server's RSS bounded, and its GPU memory
# sampled every 5 s by nvidia-smi. Saves the locust report, the GPU memory trace and /metrics
# before and after under $OUT/load (or /tmp/load-gpu).
#   PORT=8000 USERS=32 RUN_TIME=300 PROMPT_TOKENS=8192 LONG_PROMPT_TOKENS=65536 bash dev/gpu/load_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
port=${PORT:-8000}; out=${OUT:-/tmp/load-gpu}/load; mkdir -p "$out"
host=http://127.0.0.1:$port
max_len=$(curl -sf "$host/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['max_model_len'])") \
  || { echo "no server answering on $host"; exit 2; }
curl -sf "$host/metrics" > "$out/metrics-before.txt"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -l 5 > "$out/gpu-memory.csv" &
sampler=$!
MSA_TOO_LONG_PROMPT_TOKENS=$((max_len + 1000)) python3 loadtests/run_load.py --host "$host" --profile soak \
  --users "${USERS:-32}" --run-time "${RUN_TIME:-300}" --prompt-tokens "${PROMPT_TOKENS:-8192}" \
  --long-prompt-tokens "${LONG_PROMPT_TOKENS:-65536}" --max-tokens "${MAX_TOKENS:-64}" \
  --server-pid "$(cat "/tmp/gpu-server/serve-$port.pid")" --report-dir "$out" 2>&1 | tee "$out/run_load.log"
rc=${PIPESTATUS[0]}
kill $sampler
curl -sf "$host/metrics" > "$out/metrics-after.txt"
python3 - "$out/gpu-memory.csv" <<'PY'
import sys
used = [int(line.split(",")[1].split()[0]) for line in open(sys.argv[1]) if line.strip()]
print(f"GPU memory used (MiB), {len(used)} samples every 5 s: first {used[0]}, min {min(used)}, max {max(used)}, last {used[-1]}")
PY
grep -E "^vllm:msa_[a-z_]+_total" "$out/metrics-after.txt"  # counters and the stage times (proxy time share)
exit "$rc"
