# shellcheck shell=bash  # sourced, not run: no shebang names the shell
# On the GPU machine, sourced (after recv_vllm.sh has collected every part): join the parts, check
# them, unpack the wheels and install them into /tmp/site (VLLM_SITE overrides), then set
# PYTHONPATH and PATH, and install the plugin from this tree next to vLLM (`vllm serve`, serve/bench_e2e.py and
# in-process engines find FLASH_MSA by its entry point, so a chain that skips dev/gpu/start_server.sh still serves
# FLASH_MSA). Safe to source again on a warm machine: it skips a kit install already done, and a plugin install of
# the same tree (a chain running from /tmp/site is not rewritten under it by the calls that wait for it).
# Installs with pip --no-deps --no-index --target, as ../shared/devkit/install.sh does; the kit holds
# CuTeDSL 4.8.0 too, so that kit is not needed beside this one.
_vk=/tmp/devkit-vllm
_vsite=${VLLM_SITE:-/tmp/site}
_vsha=$(cut -d' ' -f1 "$_vk/SHA256" 2>/dev/null)
if [ -z "$_vsha" ]; then
  echo "devkit-vllm: no $_vk/SHA256: run dev/gpu/recv_vllm.sh in calls carrying .devkit-vllm/SHA256" >&2; return 1
fi
if [ "$(cat "$_vsite/.devkit-vllm-ok" 2>/dev/null)" != "$_vsha" ]; then
  _vt=$SECONDS
  _vn=$(cut -d' ' -f2 "$_vk/SHA256"); _vhave=$(find "$_vk" -maxdepth 1 -name 'part*' | wc -l)
  if [ "$_vhave" != "$_vn" ] || ! (cat "$_vk"/part* | sha256sum | grep -q "^$_vsha "); then
    echo "devkit-vllm: $_vhave of $_vn parts, or corrupt (the machine went cold between calls?): send every part again" >&2
    return 1
  fi
  # The image's torchvision and torchaudio are built for its torch 2.11: beside the staged torch 2.14 their
  # import fails (operator torchvision::nms does not exist), and vLLM's M3 model module imports torchvision.
  # The kit carries the torchvision vLLM pins; torchaudio (audio models only) is left out.
  python3 -m pip uninstall -y -q torchvision torchaudio > /dev/null 2>&1
  rm -rf "$_vk/w" && mkdir -p "$_vk/w"
  if command -v xz >/dev/null; then
    cat "$_vk"/part* | xz -dc -T0 | tar xf - -C "$_vk/w" || return 1
  else  # Python's lzma, where no xz binary is installed
    cat "$_vk"/part* | python3 -c 'import lzma, sys, tarfile; tarfile.open(fileobj=lzma.open(sys.stdin.buffer), mode="r|").extractall(sys.argv[1])' "$_vk/w" || return 1
  fi
  echo "devkit-vllm: unpacked $(find "$_vk/w" -maxdepth 1 -name '*.whl' | wc -l) wheels in $((SECONDS - _vt)) s; installing into $_vsite"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_vsite" \
      "$_vk"/w/*.whl > "$_vk/pip.log" 2>&1 || ! [ -f "$_vsite/vllm/_C_stable_libtorch.abi3.so" ]; then
    cat "$_vk/pip.log" >&2; echo "devkit-vllm: pip did not install the kit into $_vsite" >&2; return 1
  fi
  grep -v 'Target directory .* already exists' "$_vk/pip.log" || true
  rm -rf "$_vk/w"
  echo "$_vsha" > "$_vsite/.devkit-vllm-ok"
  echo "devkit-vllm: installed in $((SECONDS - _vt)) s"
fi
# --target skips .pth files; CuTeDSL's adds its dsl_packages folder to sys.path.
case ":${PYTHONPATH:-}:" in
  *":$_vsite:"*) ;;
  *) export PYTHONPATH=$_vsite:$_vsite/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} ;;
esac
case ":$PATH:" in *":$_vsite/bin:"*) ;; *) export PATH=$_vsite/bin:$PATH ;; esac
_vtree=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
_vplugin=$(cd "$_vtree" && find pyproject.toml vllm_msa kernels/msa_kernels -type f \( -name '*.py' -o -name '*.toml' \) \
  | sort | xargs cat | sha256sum | cut -d' ' -f1)
if [ "$(cat "$_vsite/.vllm-msa-tree" 2>/dev/null)" != "$_vplugin" ]; then
  if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$_vsite" "$_vtree" \
      > /tmp/devkit-vllm-plugin.log 2>&1; then
    cat /tmp/devkit-vllm-plugin.log >&2; echo "devkit-vllm: the plugin (vllm_msa) did not install into $_vsite" >&2
    return 1
  fi
  echo "$_vplugin" > "$_vsite/.vllm-msa-tree"
fi
echo "devkit-vllm: vllm $(cat "$_vsite"/vllm-*.dist-info/METADATA | sed -n 's/^Version: //p') installed in $_vsite with the plugin (PYTHONPATH and PATH set)"
unset _vk _vsite _vsha _vt _vn _vhave _vtree _vplugin
