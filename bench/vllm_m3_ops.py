"""vLLM's MiniMax-M3 Triton ops (`vllm/models/minimax_m3/common/ops/index_topk.py`, `sparse_attn.py`) for the peer
benchmark, from one of three places:

  installed  the vLLM on the path (the serving kit on the GPU machine): its own modules;
  staged     the two files as vLLM 0.34.0's wheel ships them, staged beside the kernel kit by
             `bash dev/gpu/stage_m3_ops.sh` (into .devkit-m3ops/, carried to the GPU machine), where no vLLM is
             installed: loaded on the image's torch and Triton, with stand-ins for the vLLM helpers they import
             (_stand_ins: `current_platform`'s CUDA capability checks as vLLM's CUDA platform answers them,
             `triton_utils`' triton and tl, `math_utils.round_up`). The kernel kit then runs the peer bench.
  interpret  (bench_vs_vllm_m3 --smoke, CPU) the installed vLLM's two files loaded on their own for Triton's
             interpreter: vLLM disables Triton without a GPU and its M3 package imports CUDA-only code.

`source()` says which one a run used and its versions, for the report's header.
"""

import importlib.metadata
import importlib.util
import os
import sys
import types
from functools import cache
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGED = Path(os.environ.get("VLLM_M3_OPS", ROOT / ".devkit-m3ops"))
NAMES = ("index_topk", "sparse_attn")


class _CudaPlatform:
    """The part of vLLM's `current_platform` (platforms/cuda.py, interface.py) the two op files ask."""

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def _capability() -> tuple[int, int] | None:
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    @classmethod
    def is_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls._capability()
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current == capability
        return current[0] * 10 + current[1] == capability

    @classmethod
    def is_device_capability_family(cls, capability: int, device_id: int = 0) -> bool:
        current = cls._capability()
        return current is not None and current[0] == capability // 10

    @classmethod
    def is_arch_support_pdl(cls) -> bool:
        current = cls._capability()
        return current is not None and current[0] >= 9


def _stand_ins() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs: object) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    return {
        "vllm": module("vllm", __path__=[]),
        "vllm.platforms": module("vllm.platforms", current_platform=_CudaPlatform()),
        "vllm.triton_utils": module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.utils": module("vllm.utils", __path__=[]),
        "vllm.utils.math_utils": module("vllm.utils.math_utils", round_up=lambda x, y: (x + y - 1) // y * y),
    }


def _load_files(folder: Path, prefix: str) -> tuple[types.ModuleType, ...]:
    modules = []
    for name in NAMES:
        spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", folder / f"{name}.py")
        assert spec is not None and spec.loader is not None, folder / f"{name}.py"
        modules.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(modules[-1])
    return tuple(modules)


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def staged_version() -> str | None:
    version = STAGED / "VERSION"
    return version.read_text().strip() if version.is_file() else None


@cache
def m3_ops(interpret: bool) -> tuple[types.ModuleType, types.ModuleType]:
    """(index_topk, sparse_attn) modules: see the module docstring for where they come from."""
    if interpret:
        import triton
        import vllm
        import vllm.triton_utils

        vllm.triton_utils.triton, vllm.triton_utils.tl = triton, triton.language
        index_topk, sparse_attn = _load_files(Path(vllm.__file__).parent / "models/minimax_m3/common/ops", "interp")
        for kernel in (index_topk._topk_index_kernel, index_topk._topk_index_partial_kernel):
            kernel.fn.configs = [min(kernel.fn.configs, key=lambda c: c.kwargs["BLOCK_SIZE_K"])]
        return index_topk, sparse_attn
    if installed():
        from vllm.models.minimax_m3.common.ops import index_topk, sparse_attn

        return index_topk, sparse_attn
    if staged_version() is None:
        raise SystemExit(
            f"bench_vs_vllm_m3: no vLLM installed and no staged M3 ops in {STAGED}: run "
            "`bash dev/gpu/stage_m3_ops.sh` here and carry .devkit-m3ops, or install the serving kit"
        )
    missing = {name: m for name, m in _stand_ins().items() if name not in sys.modules}
    sys.modules.update(missing)  # only while the files import: no stand-in outlives the load
    try:
        index_topk, sparse_attn = _load_files(STAGED, "vllm_m3")
    finally:
        for name in missing:
            del sys.modules[name]
    return index_topk, sparse_attn


def source() -> str:
    """Where the ops came from and on what, e.g. 'vLLM 0.34.0 (staged files), Triton 3.6.0, torch 2.11.0'."""
    import triton

    if installed():
        where = f"vLLM {importlib.metadata.version('vllm')}"
    else:
        where = f"{staged_version()} (staged files, stand-ins for vLLM's helpers)"
    return f"{where}, Triton {triton.__version__}, torch {torch.__version__}"
