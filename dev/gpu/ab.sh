#!/usr/bin/env bash
# On the GPU machine: time two trees against each other, alternating, in one lease (a candidate against the served
# code: METHOD.md's interleaved runs). Each run is COMMAND in one tree with that tree's kernels and benchmarks first
# on PYTHONPATH; the order alternates A B B A A B ... so each tree runs first as often as second.
#   bash dev/gpu/ab.sh RUNS TREE_A TREE_B -- COMMAND...
# TREE: a folder holding a checkout (. for the working tree; another commit's tree exported here with
# `mkdir -p .devcalls/NAME && git archive REV | tar x -C .devcalls/NAME`, carried). Logs: $OUT/ab_<A|B>_<i>.log (or
# /tmp/ab), and a line per run here with the command's last output line.
set -uo pipefail
runs=${1:?usage: bash dev/gpu/ab.sh RUNS TREE_A TREE_B -- COMMAND...}
tree_a=${2:?} tree_b=${3:?}
[ "${4:-}" = "--" ] || { echo "usage: bash dev/gpu/ab.sh RUNS TREE_A TREE_B -- COMMAND..." >&2; exit 2; }
shift 4
out=${OUT:-/tmp/ab}; mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  if [ $((i % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for side in $order; do
    if [ "$side" = A ]; then tree=$tree_a; else tree=$tree_b; fi
    log=$out/ab_${side}_$i.log
    (cd "$tree" && PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-} "$@") > "$log" 2>&1
    echo "run $i $side ($tree, rc $?): $(tail -1 "$log")"
  done
done
