#!/usr/bin/env bash
# The prefill attention before (03bed73: union bound, handled flags, stages, warpgroups) and after (HEAD), alternating.
set -u
mkdir -p runs "$OUT"
[ -f runs/trained-selections.pt ] || gunzip -c .devcalls/trained-selections.pt.gz > runs/trained-selections.pt
for i in 1 2; do
  for tree in knobs head; do
    if [ $tree = knobs ]; then dir=.devcalls/knobs; else dir=.; fi
    (cd $dir && PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH timeout 120 python3 -m bench.bench_prefill_attention \
      --trained "$OLDPWD/runs/trained-selections.pt") > "$OUT/prefill_${tree}_$i.log" 2>&1
    echo "$tree $i"; grep "trained\|^| 131072 | 1 " "$OUT/prefill_${tree}_$i.log"
  done
done
