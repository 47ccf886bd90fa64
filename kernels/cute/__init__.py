"""CuTeDSL kernels for Hopper (sm_90a), behind the same functions as kernels.reference.

proxy_scores  causal max-pooled proxy block scores (decode/SIMT path)

Kernels compile once per parameter set and process (functools.cache) and are called with the torch
tensors converted through dlpack. This module imports no CuTeDSL until a kernel is needed.
"""

import functools

import torch

from kernels.shapes import MSAShape, PagedBatch


def proxy_scores_supported(index_head_dim: int, block_size: int) -> bool:
    """Shapes the proxy score kernel serves: 128-token blocks, 16-byte row chunks within a warp."""
    return block_size == 128 and index_head_dim % 8 == 0 and 32 % (index_head_dim // 8) == 0


@functools.cache
def _proxy_score_kernel(num_index_heads: int, num_index_key_heads: int, index_head_dim: int, block_size: int):
    from kernels.cute.proxy_scores import ProxyScoreParams, compile_proxy_scores

    return compile_proxy_scores(ProxyScoreParams(num_index_heads, num_index_key_heads, index_head_dim, block_size))


def _cute(t: torch.Tensor):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


def proxy_block_scores(
    index_q: torch.Tensor, proxy_cache: torch.Tensor, batch: PagedBatch, shape: MSAShape
) -> torch.Tensor:
    """Same contract as kernels.reference.proxy_block_scores, for bf16 inputs on a CUDA device."""
    kernel = _proxy_score_kernel(
        shape.num_index_heads, shape.num_index_key_heads, shape.index_head_dim, shape.block_size
    )
    positions = batch.positions.to(torch.int32)
    out = torch.empty(
        (batch.num_tokens, shape.num_index_heads, batch.block_table.shape[1]),
        dtype=torch.float32, device=index_q.device,
    )
    args = (index_q, proxy_cache, batch.block_table.to(torch.int32), batch.token_requests, positions, out.view(-1))
    kernel(*(_cute(t) for t in args))
    return out
