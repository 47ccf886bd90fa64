"""What every launcher of kernels/cute needs at run time: compiled kernels, tensor conversion, the stream.

compiled_kernel  a kernel class compiled once per parameter set: in memory per process, CuTeDSL's
                 exported object file on disk across processes
as_cute          a torch tensor in the kernels' argument form (dlpack, fully dynamic layout)
current_stream   torch's current CUDA stream, so kernels run in order with torch ops and in graphs
num_sms          streaming multiprocessors of a device (split-K sizing)
contiguous_out / copy_into
                 the contiguous output a kernel writes, and its copy into a caller's strided `out`

Imports no CuTeDSL until a kernel is compiled or a tensor converted.
"""

import functools
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

logger = logging.getLogger("vllm.msa.kernels")  # under vllm's logger, so serving logs show compile times


@functools.cache
def compiled_kernel(kernel_cls: type, params: Hashable) -> Callable[..., Any]:
    """kernel_cls(params) compiled on its symbolic kernel_cls.fake_arguments(params), once per process and kept
    on disk.

    The disk cache (VLLM_MSA_KERNEL_CACHE, default ~/.cache/vllm_msa/kernels) holds CuTeDSL's exported
    object file per (kernel class, kernel sources: every file of kernels/cute, params, CuTeDSL version,
    GPU arch), named after the class; a later process loads it in milliseconds instead of compiling
    for seconds. Each compile or load is logged with its time.
    """
    import cutlass.cute as cute
    from cutlass import __version__ as cutlass_version
    from cutlass.cute.runtime import load_module

    kernel_name = kernel_cls.__name__
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):  # the kernel and the helpers it shares
        digest.update(path.read_bytes())
    for part in (f"{kernel_cls.__module__}.{kernel_cls.__qualname__}", repr(params), cutlass_version, _target_arch()):
        digest.update(part.encode())
    name = f"{kernel_name}_{digest.hexdigest()[:20]}"
    cached = _cache_dir() / f"{name}.o"
    start = time.perf_counter()
    if cached.exists():
        try:
            kernel = getattr(load_module(str(cached)), name)
            logger.info("loaded %s %s from %s in %.3f s", kernel_name, params, cached, time.perf_counter() - start)
            return kernel
        except Exception as error:  # a truncated or foreign file: compile again and replace it
            logger.warning("ignoring unreadable kernel cache file %s: %s", cached, error)
    kernel = cute.compile(kernel_cls(params), *kernel_cls.fake_arguments(params))
    logger.info("compiled %s %s in %.2f s", kernel_name, params, time.perf_counter() - start)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            kernel.export_to_c(tmp, name, function_prefix=name)
            os.replace(Path(tmp) / f"{name}.o", cached)
    except OSError as error:
        logger.warning("kernel cache %s is not writable (%s): kernels compile in every process", cached.parent, error)
    return kernel


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


def as_cute(t: torch.Tensor, rows16: bool = False) -> "cute.Tensor":
    """The kernels' argument form (see kernels/cute/fake.py): fully dynamic layout, unit innermost stride.

    rows16: the kernel reads or writes 16-byte row chunks, so base and strides must be 16-byte aligned.
    """
    from cutlass.cute.runtime import from_dlpack

    if rows16 and (t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1])):
        raise ValueError(f"CuTeDSL kernel needs 16-byte aligned rows, got strides {t.stride()}")
    return from_dlpack(t, assumed_align=16 if rows16 else t.element_size()).mark_layout_dynamic(leading_dim=t.dim() - 1)


def current_stream() -> "cuda.CUstream":
    """torch's current stream, so the kernels run in order with torch ops and inside CUDA graph capture."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


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
