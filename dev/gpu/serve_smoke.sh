#!/usr/bin/env bash
# The serving smoke: the first thing to run on every GPU machine that gets the serving kit, after
# `source dev/gpu/install_vllm.sh`. A change to vllm_msa/ is done only when this has passed on the GPU with it.
#   bash dev/gpu/serve_smoke.sh [more `vllm serve` flags]
# 1. `vllm serve models/needle-msa --attention-backend FLASH_MSA` (the model serve/demo.sh serves; vLLM's defaults,
#    CUDA graphs on: dev/gpu/start_server.sh) and, through dev/gpu/smoke_requests.py, a pass-key prompt by text on
#    /v1/completions (the key must come back), the same prompt as a chat message (must be answered; the key is
#    reported, not required: the model was never trained on the chat format), a bad request (must get a 400 that
#    names the field, and the server must answer after it), completions of PROMPTS token lengths;
# 2. the tiny MiniMax-M3 greedy test against vLLM's own M3 path (tests/test_minimax_m3.py -m gpu -k greedy).
# Writes $OUT/serve_smoke.log (or /tmp/serve-smoke/): date, commit, GPU, vLLM, each check's PASS/FAIL, the server
# log's start-up facts; the server log beside it. Exit status 0 only when every check passed. Copy the log into
# results/smoke/ with the run.
# COMMIT names the tree's commit where the tree has no .git (the device machine). A server that start_server.sh
# started on PORT in an earlier call is used as it is and left running; KEEP=1 leaves one started here running.
# PARTS="serve m3" (default) runs both parts; one of them runs that part alone (its log: serve_smoke-PART.log), for
# a lease short of time (the M3 test starts two engines: minutes).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-/tmp/serve-smoke}; mkdir -p "$out"
parts=${PARTS:-serve m3}
log=$out/serve_smoke.log
[ "$parts" = "serve m3" ] || log=$out/serve_smoke-${parts// /-}.log
export PORT=${PORT:-8000} PROMPTS=${PROMPTS:-16 2000 8000}
export MODEL=${MODEL:-models/needle-msa}
pid_file=/tmp/gpu-server/serve-$PORT.pid
failed=()
{
  echo "serve_smoke $(date -u '+%F %T') UTC, commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  python3 -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")' 2>&1 | tail -1
} | tee "$log"

serve_part() {  # vllm serve MODEL with FLASH_MSA, dev/gpu/smoke_requests.py against it, its log checked
  local started_here=0
  if ! { [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; }; then
    bash dev/gpu/start_server.sh "$@" | tee -a "$log" || failed+=("start")
    started_here=1
  fi
  if bash dev/gpu/wait_server.sh >> "$log" 2>&1; then
    python3 dev/gpu/smoke_requests.py 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("requests")
  else
    failed+=("server start")
    tail -40 "$log"
  fi
  if [ "$started_here" = 1 ] && [ "${KEEP:-0}" != 1 ]; then
    kill "$(cat "$pid_file")" 2>/dev/null
    sleep 5
  fi
  cp "/tmp/gpu-server/serve-$PORT.log" "$out/serve.log" 2>/dev/null
  # Errors until the shutdown starts: vLLM 0.34 stops its engine with timeout 0 on SIGTERM and its output handler
  # then logs "AsyncLLM output_handler failed" with a traceback, which is its shutdown, not a failed request.
  if awk '/\[shutdown\]/ { exit } { print }' "$out/serve.log" 2>/dev/null \
    | grep -E "Traceback| ERROR [0-9]" > "$out/serve_errors.log"; then
    echo "FAIL server log: errors before its shutdown (serve_errors.log):" | tee -a "$log"; head -5 "$out/serve_errors.log" | tee -a "$log"
    failed+=("server log")
  fi
}

m3_part() {  # the tiny MiniMax-M3 checkpoint: FLASH_MSA's greedy tokens against vLLM's own M3 path
  echo "== tiny MiniMax-M3: greedy tokens against vLLM's own M3" | tee -a "$log"
  PYTHONPATH=$PWD:${PYTHONPATH:-} timeout "${M3_TIMEOUT:-900}" python3 -m pytest -q -rf --tb=short -m gpu -k greedy \
    -p no:cacheprovider tests/test_minimax_m3.py -s > "$out/m3_greedy.log" 2>&1
  local rc=$?
  grep -E "greedy tokens equal|passed|failed|skipped|Error" "$out/m3_greedy.log" | tail -4 | tee -a "$log"
  if [ "$rc" = 0 ] && grep -q "1 passed" "$out/m3_greedy.log"; then
    echo "PASS tiny-M3 greedy test" | tee -a "$log"
  else
    echo "FAIL tiny-M3 greedy test (rc $rc; m3_greedy.log)" | tee -a "$log"; failed+=("tiny-M3")
  fi
}

[[ " $parts " == *" serve "* ]] && serve_part "$@"
[[ " $parts " == *" m3 "* ]] && m3_part

if [ ${#failed[@]} = 0 ]; then
  echo "serve_smoke ($parts): PASS" | tee -a "$log"
else
  echo "serve_smoke ($parts): FAIL (${failed[*]})" | tee -a "$log"; exit 1
fi
