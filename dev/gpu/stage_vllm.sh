#!/usr/bin/env bash
# Stage vLLM 0.34.0 (its PyPI wheel: the CUDA 13 build) with the torch 2.14.0, torchvision and Triton it
# pins, NCCL 2.30.7 (torch 2.14's libtorch needs symbols the GPU image's NCCL 2.28.9 lacks) and what the GPU
# machine lacks of the rest of its requirements, for the GPU machine (no package index, at most
# 64 MiB a device call).
#
#   bash dev/gpu/stage_vllm.sh [--resolve] [--keep-fa2]
#
#   --resolve   re-run pip's resolution for vllm==$vllm_version (cp312, manylinux x86_64) and rewrite
#               dev/gpu/vllm-gpu.lock; without it the pinned lock is staged as it is.
#   --keep-fa2  keep FlashAttention-2 (vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so) in the vllm wheel;
#               about 2 more parts. By default it is removed: on sm_90 vLLM runs FA3.
#
# Wheels are rewritten uncompressed, tarred, packed with xz -3 on every core (xz finds the long repeats in GPU
# binaries that the wheels' deflate misses; -3 packs 5x faster than -6 for 5% more bytes: 23 parts instead of 22)
# and split into parts of 48 MiB in .devkit-vllm/ (ignored through .git/info/exclude). Each part travels in its own
# device call (see dev/gpu/README.md); dev/gpu/recv_vllm.sh collects them on the GPU machine,
# dev/gpu/install_vllm.sh installs them into /tmp/site. Needs python3 with pip, xz, tar, split, sha256sum;
# downloads ~1.5 GB from PyPI into .devkit-vllm-cache/ (ignored; wheels already there are not downloaded again).
# Reuse: .devkit-vllm/KEY holds the hash of what the kit is made from (the lock, kit.py, this script, the
# options); a kit whose KEY matches is kept as it is, so a later session with the same lock stages in seconds.
# On 2 cores (2026-12-06): 450 s from an empty cache, 404 of them xz; 5 s when kept.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(git -C "$here" rev-parse --show-toplevel)
kit="$top/.devkit-vllm"
lock="$here/vllm-gpu.lock"
kinds=${KINDS_MD:-/work/.library/device/KINDS.md}
vllm_version=0.34.0
torch_version=2.14.0
resolve=0; keep_fa2=()
for a in "$@"; do
  case $a in
    --resolve) resolve=1 ;;
    --keep-fa2) keep_fa2=(--keep-fa2) ;;
    *) echo "usage: bash dev/gpu/stage_vllm.sh [--resolve] [--keep-fa2]" >&2; exit 2 ;;
  esac
done
step() { echo "[stage_vllm $(date +%T)] $*"; }
start=$SECONDS
# cp312 manylinux x86_64: pip matches manylinux_2_N exactly, so name every N the wheels use.
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform linux_x86_64
      --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do plat+=(--platform "manylinux_2_${n}_x86_64"); done

git_dir=$(git -C "$top" rev-parse --git-common-dir)
mkdir -p "$git_dir/info"
for ignored in /.devkit-vllm/ /.devkit-vllm-cache/; do
  grep -qx "$ignored" "$git_dir/info/exclude" 2>/dev/null || echo "$ignored" >> "$git_dir/info/exclude"
done
work=$(mktemp -d "${TMPDIR:-/tmp}/stage_vllm.XXXXXX")
trap 'rm -rf "$work"' EXIT
cache=$top/.devkit-vllm-cache/dl
mkdir -p "$cache"

# vLLM, locust for the load tests on the GPU server (the version of requirements/test.txt), and the NCCL
# that torch 2.14.0 imports with on the GPU image (kit.py FORCE).
roots=("vllm==$vllm_version" locust==2.47.0 nvidia-nccl-cu13==2.30.7)
if [ $resolve = 1 ]; then
  step "resolving ${roots[*]} for cp312/manylinux x86_64 with pip (metadata only)"
  # vLLM's own wheel with kit.py's PIN_OVERRIDES applied to its requirements (a pin PyPI no longer serves).
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/root" "vllm==$vllm_version" \
    2> >(grep -v 'is ignored: it is neither' >&2)
  mkdir -p "$work/root/pinned"
  python3 "$here/kit.py" repack "$work/root" "$work/root/pinned" --keep-fa2
  python3 -m pip install -q --dry-run --ignore-installed --no-cache-dir "${plat[@]}" --target "$work/t" \
    --report "$work/report.json" "$work"/root/pinned/vllm-*.whl "${roots[@]:1}" \
    2> >(grep -v 'is ignored: it is neither' >&2)
  python3 "$here/kit.py" resolve "$work/report.json" "$kinds" "$lock" "${roots[@]}"
fi

key=$(cat "$lock" "$here/kit.py" "$0" <(echo "${keep_fa2[*]}") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$kit/KEY" 2>/dev/null)" = "$key" ] && (cd "$kit" && cat part* | sha256sum | grep -q "^$(cut -d' ' -f1 SHA256) "); then
  step "kept: .devkit-vllm/ was made from this lock, kit.py and script (KEY $key)"
  n=$(find "$kit" -maxdepth 1 -name 'part*' | wc -l)
else
  grep -o '^[^# ]*' "$lock" > "$work/pins.txt"
  step "downloading the wheels pinned in dev/gpu/vllm-gpu.lock that .devkit-vllm-cache/ lacks (of $(wc -l < "$work/pins.txt"))"
  # Three pip processes side by side (each fetches one wheel at a time), into the cache.
  split -n l/3 "$work/pins.txt" "$work/pins."
  for part in "$work"/pins.a?; do
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$cache" -r "$part" 2> >(grep -v 'is ignored: it is neither' >&2) &
  done
  wait
  mkdir -p "$work/dl"
  while read -r pin; do  # the pinned wheels only: the cache may hold other versions from an older lock
    name=$(echo "${pin%%==*}" | tr '.-' '__'); version=${pin#*==}
    found=$(find "$cache" -maxdepth 1 -iname "${name}-${version}-*.whl" | head -1)
    [ -n "$found" ] || { echo "stage_vllm: no wheel of $pin in $cache" >&2; exit 1; }
    ln -s "$found" "$work/dl/"
  done < "$work/pins.txt"
  # The CUDA build check: vLLM's extensions must link CUDA 13's runtime, like the GPU image's CUDA 13.
  unzip -p "$work"/dl/vllm-$vllm_version-*.whl vllm/_C_stable_libtorch.abi3.so > "$work/c.so"
  readelf -d "$work/c.so" | grep -q 'libcudart.so.13' \
    || { echo "stage_vllm: vllm's _C_stable_libtorch does not link libcudart.so.13: not the CUDA 13 build" >&2; exit 1; }
  unzip -p "$work"/dl/vllm-$vllm_version-*.whl '*.dist-info/METADATA' | grep -qx "Requires-Dist: torch==$torch_version" \
    || { echo "stage_vllm: the vllm wheel does not pin torch==$torch_version" >&2; exit 1; }
  rm "$work/c.so"
  step "$(du -smL "$work/dl" | cut -f1) MB of wheels; rewriting them uncompressed"
  python3 "$here/kit.py" repack "$work/dl" "$work/kit" "${keep_fa2[@]}"
  step "packing $(du -sm "$work/kit" | cut -f1) MB of stored wheels with xz -3 on $(nproc) cores (minutes)"
  rm -rf "$kit" && mkdir -p "$kit"
  (cd "$work/kit" && tar cf - --sort=name -- *.whl) | xz -T0 -3 > "$work/kit.tar.xz"
  rm -rf "$work/kit"
  (cd "$kit" && split -b 48M -d -a 2 "$work/kit.tar.xz" part)
  n=$(find "$kit" -maxdepth 1 -name 'part*' | wc -l)
  echo "$(sha256sum < "$work/kit.tar.xz" | cut -d' ' -f1) $n" > "$kit/SHA256"
  echo "$key" > "$kit/KEY"
  step "packed $(du -sm "$work/kit.tar.xz" | cut -f1) MB in $n parts"
fi
step "done in $((SECONDS - start)) s"
ls -l "$kit"
last=$(printf '%02d' $((n - 1)))
cat <<MSG

Device calls, back to back (the machine stays warm only ~30 s after a call; /tmp/devkit-vllm on it
holds the parts while it stays warm). One call per part, $n in all:
MSG
for i in $(seq 0 $((n - 2))); do
  p=$(printf '%02d' "$i")
  echo "  call $((i + 1)): carry [\".devkit-vllm/part$p\", \".devkit-vllm/SHA256\"]  command: bash dev/gpu/recv_vllm.sh"
done
echo "  call $n: carry [\".devkit-vllm/part$last\", \".devkit-vllm/SHA256\"]  command:"
echo "      bash dev/gpu/recv_vllm.sh && source dev/gpu/install_vllm.sh && python3 dev/gpu/check_vllm.py"
echo "Later calls on the same warm machine: source dev/gpu/install_vllm.sh (skips the install) before using vllm."
