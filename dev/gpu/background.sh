#!/usr/bin/env bash
# On the GPU machine: run work that outlasts one device call (at most 600 s) in the background, from its
# own copy of the working tree (later calls replace the tree), and wait for it over as many calls as it
# needs. Each call runs the same command line; the first starts the job, every call waits up to WAIT
# seconds (default 540) for it, prints the log's tail and packs OUT_DIR and the log into $OUT/NAME.tgz: the files
# of at most PACK_MAX_KIB (default 4096; a device call returns at most 16 MiB a file), the others named.
#   bash dev/gpu/background.sh NAME OUT_DIR -- COMMAND...
# e.g. (after `source dev/gpu/install_vllm.sh`):
#   bash dev/gpu/background.sh e2e /tmp/e2e -- python3 serve/bench_e2e.py /tmp/m3a --input-lens 32768 131072 \
#       --parallel-start --startup-timeout 600 --out /tmp/e2e -- --kv-cache-memory-bytes 22G
# /tmp/bg-NAME/: tree/ (the copy), log, rc (the command's exit status once it ends). The command runs in
# its own process session with the caller's environment (PYTHONPATH gets the copy first).
set -uo pipefail
name=${1:?usage: bash dev/gpu/background.sh NAME OUT_DIR -- COMMAND...}
out_dir=${2:?usage: bash dev/gpu/background.sh NAME OUT_DIR -- COMMAND...}
[ "${3:-}" = "--" ] || { echo "usage: bash dev/gpu/background.sh NAME OUT_DIR -- COMMAND..." >&2; exit 2; }
shift 3
job=/tmp/bg-$name
if [ ! -d "$job" ]; then
  mkdir -p "$job/tree"
  tar cf - --exclude=./.devkit-vllm . | tar xf - -C "$job/tree"
  # shellcheck disable=SC2016  # $0 and $@ expand in the inner bash: the job folder and the command
  (cd "$job/tree" && PYTHONPATH="$PWD:${PYTHONPATH:-}" setsid bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' \
    "$job" "$@" > /dev/null 2>&1 < /dev/null &)
  echo "background $name: started in $job"
fi
for _ in $(seq 1 $(( ${WAIT:-540} / 5 ))); do [ -f "$job/rc" ] && break; sleep 5; done
echo "background $name: $([ -f "$job/rc" ] && echo "exit status $(cat "$job/rc")" || echo "still running")"
tail -n "${TAIL:-30}" "$job/log"
if [ -n "${OUT:-}" ]; then
  cp "$job/log" "$job/$name.log"
  packed=("${job#/}/$name.log")
  [ -e "$out_dir" ] && packed+=("${out_dir#/}")
  max_kib=${PACK_MAX_KIB:-4096}
  (cd / && find "${packed[@]}" -type f -size +"${max_kib}k") | sed "s|^|background $name: not packed, over $max_kib KiB: /|"
  (cd / && find "${packed[@]}" -type f ! -size +"${max_kib}k" -print0) | tar czf "$OUT/$name.tgz" -C / --null -T -
fi
