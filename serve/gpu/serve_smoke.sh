#!/usr/bin/env bash
# On the GPU machine, after `source serve/gpu/install_vllm.sh`: install the plugin next to the staged
# vLLM, build the demo MSA model, run the real `vllm serve --attention-backend FLASH_MSA` (CUDA graphs
# on, vLLM's defaults), send OpenAI requests, and keep the logs under $OUT (or /tmp/serve-smoke).
#   bash serve/gpu/serve_smoke.sh [more `vllm serve` flags]
# PRESET=m3-attention builds the model with MiniMax-M3's attention shapes and a 136K context;
# PROMPTS lists the completion prompt lengths (default "16 2000 8000"; e.g. "16 8000 65536 131072").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/serve-smoke}; mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . > "$out/plugin.log" 2>&1 \
  || { cat "$out/plugin.log"; exit 1; }
preset=${PRESET:-default}
model=/tmp/demo-msa-$preset
python3 serve/build_demo_model.py "$model" --preset "$preset" > "$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
max_len=$(python3 -c "import json; print(json.load(open('$model/config.json'))['max_position_embeddings'])")
export PROMPTS=${PROMPTS:-16 2000 8000}
start=$SECONDS
vllm serve "$model" --attention-backend FLASH_MSA --served-model-name demo-msa \
  --host 127.0.0.1 --port 8000 --max-model-len "$max_len" --gpu-memory-utilization 0.5 "$@" > "$out/serve.log" 2>&1 &
server=$!
until curl -sf 127.0.0.1:8000/health > /dev/null; do
  if ! kill -0 $server 2>/dev/null || [ $((SECONDS - start)) -gt 300 ]; then
    echo "server did not come up after $((SECONDS - start)) s"; tail -60 "$out/serve.log"; kill $server 2>/dev/null; exit 1
  fi
  sleep 2
done
echo "healthy after $((SECONDS - start)) s"
grep -E "MSA layers|Using .*backend|CUDA graph|Graph capturing|compiled|loaded sparse|KV cache" "$out/serve.log" | cut -c1-300 | head -20
python3 - <<'PY' 2>&1 | tee "$out/requests.log"
import json, os, time, urllib.request
def post(path, body):
    req = urllib.request.Request("http://127.0.0.1:8000" + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.time(); r = json.load(urllib.request.urlopen(req, timeout=600)); return r, time.time() - t
for n in map(int, os.environ["PROMPTS"].split()):  # token ids cycle below the demo vocabulary (4096)
    prompt = [5 + i % 4000 for i in range(n)]
    r, dt = post("/v1/completions", {"model": "demo-msa", "prompt": prompt, "max_tokens": 32, "temperature": 0})
    print(f"prompt {n} tokens: {r['usage']} in {dt:.2f} s: {r['choices'][0]['text'][:40]!r}")
r, dt = post("/v1/chat/completions", {"model": "demo-msa", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
print(f"chat: {r['usage']} in {dt:.2f} s")
PY
kill $server; wait $server 2>/dev/null
grep -iE "error|traceback" "$out/serve.log" | head -10
