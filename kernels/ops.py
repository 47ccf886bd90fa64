"""The MSA entry points callers use: each step runs a CuTeDSL kernel where one serves the inputs
(Hopper GPU, bf16, supported shape) and the PyTorch reference otherwise.

    proxy scores      CuTeDSL on sm_90 (kernels/cute/proxy_scores.py), else reference
    top-k selection   reference (torch ops, on the inputs' device)
    sparse attention  reference
"""

import functools

import torch

from kernels import reference
from kernels.cute import proxy_scores_supported
from kernels.shapes import MSAShape, PagedBatch


@functools.cache
def _cute_available(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    return True


def uses_cute_proxy_scores(index_q: torch.Tensor, shape: MSAShape) -> bool:
    return (
        index_q.is_cuda
        and index_q.dtype == torch.bfloat16
        and proxy_scores_supported(shape.index_head_dim, shape.block_size)
        and _cute_available(index_q.device.index or 0)
    )


def describe(device: torch.device, dtype: torch.dtype, shape: MSAShape) -> str:
    """Which implementation runs each step, for startup logs."""
    probe = torch.empty(0, device=device, dtype=dtype)
    proxy = "CuTeDSL" if uses_cute_proxy_scores(probe, shape) else "PyTorch"
    return f"proxy scores: {proxy}, top-k: PyTorch, sparse attention: PyTorch"


def proxy_block_scores(index_q, proxy_cache, batch: PagedBatch, shape: MSAShape) -> torch.Tensor:
    if uses_cute_proxy_scores(index_q, shape):
        from kernels import cute

        return cute.proxy_block_scores(index_q.contiguous(), proxy_cache, batch, shape)
    return reference.proxy_block_scores(index_q, proxy_cache, batch, shape)


def msa_attention(q, index_q, kv_cache, proxy_cache, batch: PagedBatch, shape: MSAShape, scale: float,
                  out=None, proxy_batch: PagedBatch | None = None):
    """The whole MSA layer once the caches hold the new tokens: returns (output [T, Hq, D], selected blocks).

    proxy_batch: the proxy cache's own block table when it differs from the K/V cache's.
    """
    scores = proxy_block_scores(index_q, proxy_cache, proxy_batch or batch, shape)
    selected = reference.select_blocks(scores, batch.positions, shape)
    return reference.sparse_attention(q, kv_cache, batch, selected, shape, scale, out), selected
