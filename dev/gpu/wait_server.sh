#!/usr/bin/env bash
# Wait until the server that dev/gpu/start_server.sh started on PORT (default 8000) answers /health;
# print the startup facts from its log (backend, kernels, CUDA graphs, KV cache). Exit 1 with the log
# tail if it died or was not healthy within TIMEOUT seconds (default 400). The one shell health-wait
# (serve_smoke.sh waits through it; Python code waits through serve/local_server.py).
set -uo pipefail
port=${PORT:-8000}; log=/tmp/gpu-server/serve-$port.log; pid=$(cat "/tmp/gpu-server/serve-$port.pid")
start=$SECONDS
until curl -sf "127.0.0.1:$port/health" > /dev/null; do
  if ! kill -0 "$pid" 2>/dev/null || [ $((SECONDS - start)) -gt "${TIMEOUT:-400}" ]; then
    echo "server on port $port not healthy (waited $((SECONDS - start)) s)"; tail -80 "$log"; exit 1
  fi
  sleep 2
done
echo "server on port $port healthy (waited $((SECONDS - start)) s here)"
grep -E "MSA layers|MiniMax-M3:|Using .*backend|cudagraph_mode|CUDA graph|Graph capturing|compiled|loaded |KV cache size|init engine" \
  "$log" | cut -c1-300 | head -30 || true  # healthy: exit 0 even when the log names none of these
