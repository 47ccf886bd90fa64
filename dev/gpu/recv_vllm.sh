#!/usr/bin/env bash
# On the GPU machine, in each call that carries a part: keep the parts carried in this call under
# /tmp/devkit-vllm (which lives as long as the machine stays warm) and say how many are there.
mkdir -p /tmp/devkit-vllm
for p in .devkit-vllm/part* .devkit-vllm/SHA256; do [ -f "$p" ] && cp "$p" /tmp/devkit-vllm/; done
have=$(find /tmp/devkit-vllm -maxdepth 1 -name 'part*' | wc -l)
want=$(cut -d' ' -f2 /tmp/devkit-vllm/SHA256 2>/dev/null || echo '?')
# shellcheck disable=SC2012  # lists split's part00, part01, ... sorted, which find does not
echo "devkit-vllm: $have of $want parts in /tmp/devkit-vllm: $(cd /tmp/devkit-vllm && ls part* 2>/dev/null | tr '\n' ' ')"
