"""CuTeDSL kernels for Hopper (sm_90a), behind the same functions as kernels.reference.

proxy_scores      causal max-pooled proxy block scores (decode/SIMT path)
sparse_attention  GQA attention over the selected blocks (tensor-core MMAs, split-K for decode)
combine           merges the split-K partials

Kernels compile once per parameter set and process (functools.cache; CuTeDSL also keeps compiled
modules on disk) and are called with the torch tensors converted through dlpack. This module
imports no CuTeDSL until a kernel is needed.
"""

import dataclasses
import functools

import torch

from kernels.shapes import MSAShape, PagedBatch

CTAS_PER_SM = 4  # resident sparse-attention CTAs per SM the split-K heuristic aims for


def proxy_scores_supported(index_head_dim: int, block_size: int) -> bool:
    """Shapes the proxy score kernel serves: 128-token blocks, 16-byte row chunks within a warp."""
    return block_size == 128 and index_head_dim % 8 == 0 and 32 % (index_head_dim // 8) == 0


def sparse_attention_supported(head_dim: int, block_size: int) -> bool:
    """Shapes the sparse attention kernel serves: 128-token blocks, head dim a multiple of 32 up to 256."""
    return block_size == 128 and head_dim % 32 == 0 and head_dim <= 256


@functools.cache
def _proxy_score_kernel(num_index_heads: int, num_index_key_heads: int, index_head_dim: int, block_size: int):
    from kernels.cute.proxy_scores import ProxyScoreParams, compile_proxy_scores

    return compile_proxy_scores(ProxyScoreParams(num_index_heads, num_index_key_heads, index_head_dim, block_size))


@functools.cache
def _sparse_attention_kernel(params):
    from kernels.cute.sparse_attn import compile_sparse_attention

    return compile_sparse_attention(params)


@functools.cache
def _combine_kernel(num_q_heads: int, head_dim: int):
    from kernels.cute.combine import CombineParams, compile_combine

    return compile_combine(CombineParams(num_q_heads, head_dim))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cute(t: torch.Tensor, rows16: bool = False):
    """The kernels' argument form (see kernels/cute/fake.py): fully dynamic layout, unit innermost stride.

    rows16: the kernel reads or writes 16-byte row chunks, so base and strides must be 16-byte aligned.
    """
    from cutlass.cute.runtime import from_dlpack

    if rows16 and (t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1])):
        raise ValueError(f"CuTeDSL kernel needs 16-byte aligned rows, got strides {t.stride()}")
    return from_dlpack(t, assumed_align=16 if rows16 else t.element_size()).mark_layout_dynamic(
        leading_dim=t.dim() - 1
    )


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
    kernel(_cute(index_q.contiguous(), rows16=True), _cute(proxy_cache, rows16=True),
           *(_cute(t) for t in (batch.block_table.to(torch.int32), batch.token_requests, positions, out)))
    return out


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.sparse_attention, for bf16 inputs on a CUDA device.

    kv_cache must be contiguous; q and out may be strided views.
    """
    from kernels.cute.sparse_attn import SparseAttentionParams, num_splits

    num_tokens, hq, d = batch.num_tokens, shape.num_q_heads, shape.head_dim
    result = out if out is not None and out.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    params = SparseAttentionParams(hq, shape.num_kv_heads, shape.num_index_heads, d, shape.block_size)
    topk = selected.shape[-1]
    splits, per_split = num_splits(num_tokens, params, topk, CTAS_PER_SM * _num_sms(q.device.index or 0))
    inputs = (
        _cute(q.contiguous(), rows16=True),
        _cute(kv_cache, rows16=True),
        *(_cute(t) for t in (batch.block_table.to(torch.int32), batch.seq_lens.to(torch.int32), batch.token_requests,
                             batch.positions.to(torch.int32), selected.to(torch.int32).contiguous())),
    )
    lse = torch.empty((splits, num_tokens, hq), dtype=torch.float32, device=q.device)
    if splits == 1:
        kernel = _sparse_attention_kernel(params)
        kernel(*inputs, _cute(result.view(1, num_tokens, hq, d), rows16=True), _cute(lse), scale, per_split)
    else:
        kernel = _sparse_attention_kernel(dataclasses.replace(params, split=True))
        partial = torch.empty((splits, num_tokens, hq, d), dtype=torch.float32, device=q.device)
        kernel(*inputs, _cute(partial, rows16=True), _cute(lse), scale, per_split)
        _combine_kernel(hq, d)(_cute(partial, rows16=True), _cute(lse), _cute(result, rows16=True))
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
