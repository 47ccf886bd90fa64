#!/usr/bin/env bash
# Stage vLLM 0.34.0's MiniMax-M3 Triton op files (vllm/models/minimax_m3/common/ops/index_topk.py, sparse_attn.py,
# as its PyPI wheel ships them) into .devkit-m3ops/ (ignored through .git/info/exclude), so the peer benchmark
# (bench/bench_vs_vllm_m3.py) runs on the kernel kit alone: carry .devkit-m3ops in the device call
# (bench/vllm_m3_ops.py loads them with stand-ins for the vLLM helpers they import). vLLM's code, never committed.
#   bash dev/gpu/stage_m3_ops.sh
# Takes the vllm wheel from dev/gpu/stage_vllm.sh's download cache where it is there, else downloads it (~450 MB).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(git -C "$here" rev-parse --show-toplevel)
version=0.34.0
dest=$top/.devkit-m3ops
git_dir=$(git -C "$top" rev-parse --git-common-dir)
mkdir -p "$git_dir/info"
grep -qx '/.devkit-m3ops/' "$git_dir/info/exclude" 2>/dev/null || echo '/.devkit-m3ops/' >> "$git_dir/info/exclude"
wheel=$(find "$top/.devkit-vllm-cache/dl" -maxdepth 1 -name "vllm-$version-*.whl" 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/stage_m3_ops.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work" "vllm==$version" 2> >(grep -v 'is ignored: it is neither' >&2)
  wheel=$(find "$work" -maxdepth 1 -name "vllm-$version-*.whl" | head -1)
fi
rm -rf "$dest" && mkdir -p "$dest"
for name in index_topk sparse_attn; do
  unzip -p "$wheel" "vllm/models/minimax_m3/common/ops/$name.py" > "$dest/$name.py"
done
echo "vLLM $version" > "$dest/VERSION"
echo "stage_m3_ops: $(wc -l "$dest"/*.py | tail -1 | awk '{print $1}') lines of vLLM $version's M3 ops in $dest (carry .devkit-m3ops)"
