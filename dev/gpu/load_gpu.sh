#!/usr/bin/env bash
# On the GPU machine, against the server of dev/gpu/start_server.sh (PORT, default 8000): the
# locust soak (loadtests/run_load.py --profile soak: streaming and non-streaming completions and
# chats, long prompts, client cancellations, intended bad requests) with USERS concurrent users
# (default 32) for RUN_TIME seconds (default 300), the server's RSS bounded, and the GPU memory of its processes
# and of the whole GPU sampled every 5 s by nvidia-smi. Saves the locust report, the GPU memory trace and /metrics
# before and after under $OUT/load (or /tmp/load-gpu).
#   PORT=8000 USERS=32 RUN_TIME=300 PROMPT_TOKENS=8192 LONG_PROMPT_TOKENS=65536 bash dev/gpu/load_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
port=${PORT:-8000}; out=${OUT:-/tmp/load-gpu}/load; mkdir -p "$out"
host=http://127.0.0.1:$port
max_len=$(curl -sf "$host/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['max_model_len'])") \
  || { echo "no server answering on $host"; exit 2; }
curl -sf "$host/metrics" > "$out/metrics-before.txt"
server_pid=$(cat "/tmp/gpu-server/serve-$port.pid")
# Every 5 s: the GPU memory of the server's process tree (nvidia-smi's compute processes among its pids; empty where
# nvidia-smi lists none of them, as in a container with its own pid namespace) and of the whole GPU (MiB).
python3 - "$server_pid" > "$out/gpu-memory.csv" <<'PY' &
import subprocess, sys, time
import psutil
root = psutil.Process(int(sys.argv[1]))
print("time,server_mib,gpu_mib", flush=True)
while True:
    tree = {root.pid, *(child.pid for child in root.children(recursive=True))}
    query = ["nvidia-smi", "--format=csv,noheader,nounits"]
    apps = subprocess.run(query + ["--query-compute-apps=pid,used_memory"], capture_output=True, text=True).stdout
    used = [int(mib) for pid, mib in (line.split(",") for line in apps.splitlines() if line.strip()) if int(pid) in tree]
    gpu = subprocess.run(query + ["--query-gpu=memory.used"], capture_output=True, text=True).stdout.split()[0]
    print(f"{time.strftime('%H:%M:%S')},{sum(used) if used else ''},{gpu}", flush=True)
    time.sleep(5)
PY
sampler=$!
MSA_TOO_LONG_PROMPT_TOKENS=$((max_len + 1000)) python3 loadtests/run_load.py --host "$host" --profile soak \
  --users "${USERS:-32}" --run-time "${RUN_TIME:-300}" --prompt-tokens "${PROMPT_TOKENS:-8192}" \
  --long-prompt-tokens "${LONG_PROMPT_TOKENS:-65536}" --max-tokens "${MAX_TOKENS:-64}" \
  --server-pid "$server_pid" --report-dir "$out" 2>&1 | tee "$out/run_load.log"
rc=${PIPESTATUS[0]}
kill $sampler
curl -sf "$host/metrics" > "$out/metrics-after.txt"
python3 - "$out/gpu-memory.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for column, what in (("server_mib", "the server's processes"), ("gpu_mib", "the whole GPU")):
    used = [int(row[column]) for row in rows if row[column]]
    if used:
        print(f"GPU memory of {what} (MiB), {len(used)} samples every 5 s: first {used[0]}, min {min(used)}, "
              f"max {max(used)}, last {used[-1]}")
    else:
        print(f"GPU memory of {what}: not visible (nvidia-smi listed none of its processes)")
PY
grep -E "^vllm:msa_[a-z_]+_total" "$out/metrics-after.txt"  # counters and the stage times (proxy time share)
exit "$rc"
