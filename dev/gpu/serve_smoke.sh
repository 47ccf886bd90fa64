#!/usr/bin/env bash
# On the GPU machine, after `source dev/gpu/install_vllm.sh`: start the real
# `vllm serve --attention-backend FLASH_MSA` on the demo MSA model (dev/gpu/start_server.sh: CUDA
# graphs on, vLLM's defaults), send OpenAI requests, and keep the logs under $OUT (or /tmp/serve-smoke).
#   bash dev/gpu/serve_smoke.sh [more `vllm serve` flags]
# PRESET=m3-attention builds the model with MiniMax-M3's attention shapes and a 136K context;
# PROMPTS lists the completion prompt lengths (default "16 2000 8000"; e.g. "16 8000 65536 131072").
# A server that dev/gpu/start_server.sh started on PORT in an earlier call (its pid file names a live
# process) is used as it is and left running; KEEP=1 also leaves a server started here running for later
# calls. dev/gpu/wait_server.sh waits for either to answer /health.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-/tmp/serve-smoke}; mkdir -p "$out"
export PORT=${PORT:-8000} PROMPTS=${PROMPTS:-16 2000 8000}
pid_file=/tmp/gpu-server/serve-$PORT.pid
started_here=0
if ! { [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; }; then
  bash dev/gpu/start_server.sh "$@" || exit 1
  started_here=1
fi
bash dev/gpu/wait_server.sh || { cp "/tmp/gpu-server/serve-$PORT.log" "$out/"; exit 1; }
python3 - <<'PY' 2>&1 | tee "$out/requests.log"
import json, os, time, urllib.request
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PORT']}" + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.time(); r = json.load(urllib.request.urlopen(req, timeout=600)); return r, time.time() - t
for n in map(int, os.environ["PROMPTS"].split()):  # token ids cycle below the demo vocabulary (4096)
    prompt = [5 + i % 4000 for i in range(n)]
    r, dt = post("/v1/completions", {"model": "demo-msa", "prompt": prompt, "max_tokens": 32, "temperature": 0})
    print(f"prompt {n} tokens: {r['usage']} in {dt:.2f} s: {r['choices'][0]['text'][:40]!r}")
r, dt = post("/v1/chat/completions", {"model": "demo-msa", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
print(f"chat: {r['usage']} in {dt:.2f} s")
PY
[ "$started_here" = 0 ] || [ "${KEEP:-0}" = 1 ] || kill "$(cat "$pid_file")"
cp "/tmp/gpu-server/serve-$PORT.log" "$out/serve.log"
grep -iE "error|traceback" "$out/serve.log" | head -10
