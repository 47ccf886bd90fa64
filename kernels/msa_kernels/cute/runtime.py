"""What every launcher of kernels/cute needs at run time: compiled kernels, SM count, output buffers.

compiled_kernel  a kernel class compiled once per parameter set for CuTeDSL's TVM-FFI calling
                 convention (called with torch tensors, on torch's current stream): in memory per
                 process, the exported object file on disk across processes
num_sms          streaming multiprocessors of a device (split-K sizing)
block_scores_out where an index-score launcher writes: the step part's workspace or a new tensor
contiguous_out / copy_into
                 the contiguous output a kernel writes, and its copy into a caller's strided `out`

Imports no CuTeDSL until a kernel is compiled or loaded.
"""

import functools
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from msa_kernels.plan import Workspace
from msa_kernels.shapes import PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

logger = logging.getLogger("vllm.msa.kernels")  # under vllm's logger, so serving logs show compile times


@functools.cache
def compiled_kernel(kernel_cls: type, params: Hashable) -> "tvm_ffi.Function":
    """kernel_cls(params) compiled on kernel_cls.fake_arguments(params) with CuTeDSL's TVM-FFI calling
    convention, once per process and kept on disk.

    The result takes fake_arguments' arguments in order, less the stream (fake.env_stream): torch
    tensors as they are, which it checks against the symbolic ones (fake.py; ValueError on a mismatch),
    Python floats and ints for the scalars, None where the symbolic argument is None. It launches on
    torch's current stream. The checks and the launch run in compiled code: no Python conversion per
    call.

    The disk cache (VLLM_MSA_KERNEL_CACHE, default ~/.cache/vllm_msa/kernels) holds the exported object
    file (its TVM-FFI entry point) per (kernel class, kernel sources: every file of kernels/cute, params,
    CuTeDSL and TVM-FFI versions, GPU arch), named after the class; a later process loads it in
    milliseconds instead of compiling for seconds. Each compile or load is logged with its time.
    """
    import cutlass.cute as cute
    import tvm_ffi
    from cutlass import __version__ as cutlass_version
    from cutlass.cute.runtime import load_module

    kernel_name = kernel_cls.__name__
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):  # the kernel and the helpers it shares
        digest.update(path.read_bytes())
    versions = (cutlass_version, tvm_ffi.__version__)  # the object file calls into TVM-FFI's C library
    for part in (f"{kernel_cls.__module__}.{kernel_cls.__qualname__}", repr(params), *versions, _target_arch()):
        digest.update(part.encode())
    name = f"{kernel_name}_{digest.hexdigest()[:20]}"
    cached = _cache_dir() / f"{name}.o"
    start = time.perf_counter()
    if cached.exists():
        try:
            kernel = getattr(load_module(str(cached), enable_tvm_ffi=True), name)
            logger.info("loaded %s %s from %s in %.3f s", kernel_name, params, cached, time.perf_counter() - start)
            return kernel
        except Exception as error:  # a truncated or foreign file: compile again and replace it
            logger.warning("ignoring unreadable kernel cache file %s: %s", cached, error)
    compiled = cute.compile(kernel_cls(params), *kernel_cls.fake_arguments(params), options="--enable-tvm-ffi")
    logger.info("compiled %s %s in %.2f s", kernel_name, params, time.perf_counter() - start)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            compiled.export_to_c(str(Path(tmp) / cached.name), name)
            os.replace(Path(tmp) / cached.name, cached)
    except OSError as error:
        logger.warning("kernel cache %s is not writable (%s): kernels compile in every process", cached.parent, error)
    return compiled.__tvm_ffi_object__()  # the bare function, as loaded: no keyword-argument wrapper per call


def _cache_dir() -> Path:
    return Path(os.environ.get("VLLM_MSA_KERNEL_CACHE", "~/.cache/vllm_msa/kernels")).expanduser()


def _target_arch() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return os.environ.get("CUTE_DSL_ARCH", "")


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_scores_out(batch: PagedBatch, num_index_heads: int, workspace: Workspace | None) -> torch.Tensor:
    """Where an index-score launcher writes the block scores [T, Hi, max_blocks] fp32: the step part's workspace
    (for a caller that consumes them before its next call on the part, as top-k does), else a new tensor."""
    if workspace is None:
        workspace = Workspace(batch.block_table.device)
    return workspace.block_scores((batch.num_tokens, num_index_heads, batch.block_table.shape[1]))


def contiguous_out(
    out: torch.Tensor | None, size: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Where a kernel writes its output: the caller's `out` if contiguous, else a new tensor (see copy_into)."""
    if out is not None and out.is_contiguous():
        return out
    return torch.empty(size, dtype=dtype, device=device)


def copy_into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The kernel's contiguous result, copied into the caller's strided `out` where it was not written in place."""
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
