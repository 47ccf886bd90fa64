"""Helpers for dev/gpu/stage_vllm.sh (run here, on the staging machine; any Python >= 3.9 with pip).

    python3 dev/gpu/kit.py resolve REPORT.json KINDS.md LOCK ROOT...  # pip's resolution -> what the GPU lacks
    python3 dev/gpu/kit.py repack SRC_DIR DST_DIR [--keep-fa2]  # stored (uncompressed) wheels, vLLM trimmed

`resolve` reads a `pip install --dry-run --report` of vLLM (the ROOTs) for cp312/manylinux x86_64 and keeps
the packages reachable from the ROOTs (vllm, locust) through Requires-Dist (markers evaluated for Linux x86_64 CPython
3.12, extras followed) without passing through one the GPU machine already has (KINDS.md's list) or
one we never carry (SKIP, DROP). One version each: pip's resolver already chose it.

`repack` rewrites every wheel with ZIP_STORED members so that the xz pass over the whole kit sees the
raw bytes (GPU binaries repeat over megabytes: xz packs FA3's 146 MB into 10 MB where the wheel's
deflate needs 37 MB), removes DROP_FILES from the vllm wheel, with their RECORD lines, and applies
PIN_OVERRIDES to its METADATA (RECORD rehashed). Other hashes in RECORD stay valid: they are of the
uncompressed file contents.
"""

import base64
import hashlib
import json
import os
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as cn

# Never carried: the serving path loads it only for audio (install_vllm.sh removes the image's build, made
# for its torch 2.11).
SKIP = {"torchaudio"}

# vLLM requirements that this project never loads on the GPU (reason, and where vLLM imports them).
DROP = {
    "nvidia-cutlass-dsl-libs-cu12": "CuTeDSL's CUDA 12 build; the cu13 one (kept) serves the CUDA 13 driver",
    "tokenspeed-mla": "MLA attention backends only (v1/attention/backends/mla/*tokenspeed_mla.py, imported lazily)",
    "tokenspeed-triton": "needed by tokenspeed-mla only (a Triton fork, 95 MB)",
    "tilelang": "mHC kernels of DeepSeek-V4 only (model_executor/kernels/mhc/tilelang_kernels.py)",
    "z3-solver": "needed by tilelang only",
    "humming-kernels": "humming quantization only (vllm/utils/humming.py imports it lazily)",
    "nvidia-cuda-nvcc": "needed by humming-kernels[cu13] only (the GPU machine has nvcc 13.0)",
    "nvidia-nvvm": "needed by nvidia-cuda-nvcc only",
    "nvidia-cuda-crt": "needed by nvidia-cuda-nvcc only",
    "nvidia-cuda-cccl": "needed by humming-kernels[cu13] only",
    "pyelftools": "needed by humming-kernels only",
    "pynvvideocodec": "GPU video decoding only (multimodal/video.py imports it lazily)",
    "torchcodec": "video decoding only (multimodal/video.py falls back to a placeholder); built per torch release",
}

# Present on the GPU machine but carried anyway (a newer copy on PYTHONPATH shadows the image's one).
FORCE = {
    "torch": "vLLM pins its own torch (2.14.0 for vLLM 0.34); the image has 2.11.0",
    "triton": "the Triton that torch 2.14.0 pins; the image has 3.6.0",
    "nvidia-nccl-cu13": "torch 2.14.0 fails at import on the image's NCCL 2.28.9 (undefined symbol ncclCommResume)",
    "torchvision": "vLLM's M3 model module imports it; the image's 0.26 (for torch 2.11) fails beside torch 2.14 "
    "(operator torchvision::nms does not exist)",
    "typing-extensions": "pydantic 2.14 (carried) needs >=4.16.0; the GPU image's version is not recorded",
}

# Files removed from the vllm wheel unless --keep-fa2: FlashAttention-2 (291 MB raw, 124 MB in the
# wheel). On sm_90 vLLM's get_flash_attn_version() picks FA3 (_vllm_fa3_C, kept); FA2 is only chosen
# for ALiBi, for VLLM_BATCH_INVARIANT with FA4, or when --attention-config flash_attn_version=2 is
# asked for. flash_attn_interface.py imports _vllm_fa2_C in a try/except (FA2_AVAILABLE=False).
DROP_FILES = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"}

# Exact pins of vLLM's that PyPI no longer serves: rewritten in the vllm wheel's METADATA (for pip's
# resolution and in the staged wheel), with the reason.
PIN_OVERRIDES = {
    "flashinfer-python==0.7.3": ("flashinfer-python==0.7.4", "0.7.3 is not on PyPI; 0.7.4 is the next release"),
}

ENV = dict(
    python_version="3.12",
    python_full_version="3.12.3",
    platform_machine="x86_64",
    sys_platform="linux",
    platform_system="Linux",
    os_name="posix",
    implementation_name="cpython",
    platform_python_implementation="CPython",
    implementation_version="3.12.3",
    platform_release="",
    platform_version="",
)


def present_on_gpu(kinds_md):
    with open(kinds_md) as f:
        text = f.read().split("## Python packages already there", 1)[1]
    names = text.split("Packages:", 1)[1].split("\n\n", 1)[0].strip().rstrip(".")
    return {cn(n.strip()) for n in names.split(",") if n.strip()}


def resolve(report, kinds_md, lock, *roots):
    with open(report) as f:
        items = {cn(i["metadata"]["name"]): i for i in json.load(f)["install"]}
    present = present_on_gpu(kinds_md)
    if len(present) < 100:
        sys.exit(f"kit.py: only {len(present)} names read from {kinds_md}: its format changed?")
    need, dropped, seen = {}, {}, set()
    stack = [(cn(Requirement(root).name), frozenset(), "") for root in roots]
    while stack:
        name, extras, by = stack.pop()
        if (name, extras, by) in seen:
            continue
        seen.add((name, extras, by))
        if name in SKIP or (name in present and name not in FORCE):
            continue
        if name in DROP:
            dropped.setdefault(name, set()).add(by)
            continue
        if name not in items:
            sys.exit(f"kit.py: {name} (needed by {by}) is not in pip's resolution: resolve with a Python 3.12 pip?")
        need.setdefault(name, set()).add(by)
        for rd in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(rd)
            if req.marker is None or any(req.marker.evaluate(dict(ENV, extra=e)) for e in (extras or {""})):
                stack.append((cn(req.name), frozenset(req.extras), name))
    with open(lock, "w") as f:
        f.write(
            f"# {' '.join(roots)} (CUDA 13 builds) and what the GPU machine lacks of their requirements, for cp312\n"
            "# manylinux x86_64. Written by `bash dev/gpu/stage_vllm.sh --resolve`; read by stage_vllm.sh.\n"
            "# Not carried: torchvision/torchaudio, the packages KINDS.md lists as present,\n"
            "# and these (never loaded by this project on the GPU):\n"
        )
        for name in sorted(FORCE):
            f.write(f"# Carried although present: {name}: {FORCE[name]}\n")
        for name in sorted(dropped):
            f.write(f"#   {name}=={items[name]['metadata']['version'] if name in items else '?'}: {DROP[name]}\n")
        for name in sorted(need):
            by = ", ".join(sorted(b for b in need[name] if b)) or "-"
            f.write(f"{name}=={items[name]['metadata']['version']}  # <- {by}\n")
    print(f"kit.py: {len(need)} packages to carry, {len(dropped)} dropped, written to {lock}")


def override_pins(metadata: bytes) -> bytes:
    lines = metadata.decode().splitlines(keepends=True)
    for pin, (replacement, reason) in PIN_OVERRIDES.items():
        for i, line in enumerate(lines):
            if line.rstrip("\n") == f"Requires-Dist: {pin}":
                lines[i] = f"Requires-Dist: {replacement}\n"
                print(f"kit.py: vllm requires {replacement} instead of {pin}: {reason}")
    return "".join(lines).encode()


def record_entry(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def repack(src, dst, keep_fa2=False):
    os.makedirs(dst, exist_ok=True)
    drop = set() if keep_fa2 else DROP_FILES
    for fn in sorted(os.listdir(src)):
        if not fn.endswith(".whl"):
            continue
        removed, rehashed = [], {}
        with (
            zipfile.ZipFile(os.path.join(src, fn)) as zin,
            zipfile.ZipFile(os.path.join(dst, fn), "w", zipfile.ZIP_STORED) as zout,
        ):
            names = zin.namelist()
            record = [n for n in names if n.endswith(".dist-info/RECORD")]
            assert len(record) == 1, (fn, record)
            for info in zin.infolist():
                if info.filename in drop:
                    removed.append(info.filename)
                    continue
                data = zin.read(info)
                if fn.startswith("vllm-") and info.filename.endswith(".dist-info/METADATA"):
                    data = override_pins(data)
                    rehashed[info.filename] = record_entry(info.filename, data)
                if info.filename == record[0]:
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(
                        rehashed.get(line.split(",", 1)[0], line) for line in lines if line.split(",", 1)[0] not in drop
                    ).encode()
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr = info.external_attr  # keeps the x bits (vllm/vllm-rs)
                out.compress_type = zipfile.ZIP_STORED
                zout.writestr(out, data)
        if removed:
            print(f"kit.py: {fn}: removed {', '.join(removed)}")
        missing = drop - set(removed) if fn.startswith("vllm-") else set()
        if missing:
            sys.exit(f"kit.py: {fn} has no {missing}: vLLM's layout changed, check DROP_FILES")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "resolve":
        resolve(*args)
    elif cmd == "repack":
        repack(args[0], args[1], keep_fa2="--keep-fa2" in args[2:])
    else:
        sys.exit(__doc__)
