"""The MSA entry points callers use: each step runs a CuTeDSL kernel where one serves the inputs
(Hopper GPU, bf16, supported shape) and the PyTorch reference otherwise.

    proxy scores      CuTeDSL on sm_90 (kernels/cute/proxy_scores.py for decode batches,
                      proxy_scores_prefill.py once a request has 64+ new tokens), else reference
    top-k selection   CuTeDSL on sm_90 (kernels/cute/topk_blocks.py) for fp32 scores, else reference
    sparse attention  CuTeDSL on sm_90 (kernels/cute/sparse_attn_prefill.py + sparse_attn.py for the
                      tiles it leaves once a request brings a whole tile of new tokens, else
                      sparse_attn.py + combine.py), else reference
"""

import functools
import logging

import torch

from kernels import reference
from kernels.cute import proxy_scores_supported, sparse_attention_supported
from kernels.shapes import MSAShape, PagedBatch


CUTE_DSL_REQUIREMENT = "nvidia-cutlass-dsl==4.8.0"  # pyproject.toml's; the version vLLM 0.34 pins
logger = logging.getLogger("vllm.msa.kernels")  # under vllm's logger, so serving logs show it


@functools.cache
def _cute_available(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        import cutlass  # noqa: F401
    except ImportError as error:
        logger.warning(
            "FLASH_MSA: CuTeDSL is not importable (%s), so the MSA steps run the PyTorch path on this Hopper GPU "
            "(same results, far slower): pip install '%s'", error, CUTE_DSL_REQUIREMENT,
        )
        return False
    return True


def _on_hopper_bf16(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16 and _cute_available(t.device.index or 0)


def uses_cute_proxy_scores(index_q: torch.Tensor, shape: MSAShape) -> bool:
    return proxy_scores_supported(shape.index_head_dim, shape.block_size) and _on_hopper_bf16(index_q)


def uses_cute_topk(scores: torch.Tensor) -> bool:
    return scores.is_cuda and scores.dtype == torch.float32 and _cute_available(scores.device.index or 0)


def uses_cute_sparse_attention(q: torch.Tensor, shape: MSAShape) -> bool:
    return sparse_attention_supported(shape.head_dim, shape.block_size) and _on_hopper_bf16(q)


def describe(device: torch.device, dtype: torch.dtype, shape: MSAShape) -> str:
    """Which implementation runs each step, for startup logs."""
    probe = torch.empty(0, device=device, dtype=dtype)
    score_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # proxy scores' dtype
    proxy = "CuTeDSL" if uses_cute_proxy_scores(probe, shape) else "PyTorch"
    topk = "CuTeDSL" if uses_cute_topk(torch.empty(0, device=device, dtype=score_dtype)) else "PyTorch"
    attention = "CuTeDSL" if uses_cute_sparse_attention(probe, shape) else "PyTorch"
    return f"proxy scores: {proxy}, top-k: {topk}, sparse attention: {attention}"


def graph_capturable(device: torch.device, dtype: torch.dtype, shape: MSAShape, proxy_scores: bool = True) -> bool:
    """Whether a decode step of this layer can be recorded in a CUDA graph: the CuTeDSL kernels (and
    the reference top-k, torch ops) run without host syncs; the reference proxy scores and attention
    loop over requests on the host."""
    probe = torch.empty(0, device=device, dtype=dtype)
    served = uses_cute_sparse_attention(probe, shape)
    return served and (not proxy_scores or uses_cute_proxy_scores(probe, shape))


def proxy_block_scores(index_q, proxy_cache, batch: PagedBatch, shape: MSAShape) -> torch.Tensor:
    if uses_cute_proxy_scores(index_q, shape):
        from kernels import cute

        return cute.proxy_block_scores(index_q, proxy_cache, batch, shape)
    return reference.proxy_block_scores(index_q, proxy_cache, batch, shape)


def sparse_attention(q, kv_cache, batch: PagedBatch, selected, shape: MSAShape, scale: float, out=None):
    if uses_cute_sparse_attention(q, shape) and kv_cache.is_contiguous():
        from kernels import cute

        return cute.sparse_attention(q, kv_cache, batch, selected, shape, scale, out)
    return reference.sparse_attention(q, kv_cache, batch, selected, shape, scale, out)


def select_blocks(index_q, proxy_cache, batch: PagedBatch, shape: MSAShape) -> torch.Tensor:
    """Proxy scores, then top-k: the selected blocks [T, Hi, K] (batch: the proxy cache's block table)."""
    scores = proxy_block_scores(index_q, proxy_cache, batch, shape)
    if uses_cute_topk(scores):
        from kernels import cute

        return cute.select_blocks(scores, batch.positions, shape)
    return reference.topk_blocks(scores, batch.positions, shape)


def msa_attention(q, index_q, kv_cache, proxy_cache, batch: PagedBatch, shape: MSAShape, scale: float, out=None):
    """The whole MSA layer once the caches hold the new tokens: returns (output [T, Hq, D], selected blocks)."""
    selected = select_blocks(index_q, proxy_cache, batch, shape)
    return sparse_attention(q, kv_cache, batch, selected, shape, scale, out), selected
