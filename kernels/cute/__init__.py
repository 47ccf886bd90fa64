"""CuTeDSL kernels for Hopper (sm_90a), behind the same functions as kernels.reference.

proxy_scores          causal max-pooled proxy block scores, decode (SIMT, every token on its own)
proxy_scores_prefill  the same for prefill chunks (TMA + warpgroup MMAs, 64-token tiles of a request)
topk_blocks           top-k block selection from those scores (threshold search, one CTA per row)
sparse_attn           GQA attention over the selected blocks, one token per CTA (mma.sync, split-K
                      for decode)
sparse_attn_prefill   the same for prefill: tiles of consecutive tokens read the union of their
                      blocks once (TMA + warpgroup MMAs)
combine               merges the split-K partials
warp_mma, fake        helpers: MMA fragments, online softmax rows, tile copies, swizzles; symbolic
                      tensors for compiling

Kernels compile once per parameter set (compiled_kernel: in memory per process, exported object
files on disk across processes) and are called with the torch tensors converted through dlpack on
torch's current stream. This module imports no CuTeDSL until a kernel is needed.
"""

import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from kernels.shapes import MSAShape, PagedBatch

logger = logging.getLogger("vllm.msa.kernels")  # under vllm's logger, so serving logs show compile times


def proxy_scores_supported(index_head_dim: int, block_size: int) -> bool:
    """Shapes the proxy score kernel serves: 128-token blocks, 16-byte row chunks within a warp."""
    return block_size == 128 and index_head_dim % 8 == 0 and 32 % (index_head_dim // 8) == 0


def prefill_proxy_scores_supported(index_head_dim: int, block_size: int) -> bool:
    """Shapes the prefill proxy score kernel serves: 128-token blocks, index head dim a multiple of 32."""
    return block_size == 128 and index_head_dim % 32 == 0 and index_head_dim <= 256


PREFILL_TILE_TOKENS = 64  # query tokens per CTA of the prefill proxy kernel (the warpgroup MMA's M)


def sparse_attention_supported(head_dim: int, block_size: int) -> bool:
    """Shapes the sparse attention kernel serves: 128-token blocks, head dim a multiple of 32 up to 256."""
    return block_size == 128 and head_dim % 32 == 0 and head_dim <= 256


PREFILL_ATTENTION_ROWS = 64  # MMA rows of the prefill attention kernel: tokens per tile x heads per index head


def prefill_attention_supported(num_q_heads: int, num_index_heads: int, head_dim: int, block_size: int) -> bool:
    """Shapes the prefill sparse attention kernel serves: 128-token blocks, head dim 64 or 128,
    m = Hq / Hi query heads per index head dividing 64 with at most 16 tokens per tile (m >= 4)."""
    m = num_q_heads // num_index_heads
    return block_size == 128 and head_dim in (64, 128) and 4 <= m <= PREFILL_ATTENTION_ROWS and PREFILL_ATTENTION_ROWS % m == 0


PREFILL_MAX_UNION = 0.7  # tiles whose union exceeds this x K blocks per token go to the per-token kernel


def prefill_tile_tokens(shape: MSAShape) -> int:
    """Query tokens per tile of the prefill attention kernel."""
    return PREFILL_ATTENTION_ROWS // shape.heads_per_index_head


@functools.cache
def compiled_kernel(module: str, params):
    """The kernel of kernels/cute/<module>.py for `params`, compiled once per process and kept on disk.

    The disk cache (VLLM_MSA_KERNEL_CACHE, default ~/.cache/vllm_msa/kernels) holds CuTeDSL's exported
    object file per (kernel sources: every file of kernels/cute, params, CuTeDSL version, GPU arch); a
    later process loads it in milliseconds instead of compiling for seconds. Each compile or load is
    logged with its time.
    """
    from cutlass import __version__ as cutlass_version
    from cutlass.cute.runtime import load_module

    source = importlib.import_module(f"kernels.cute.{module}")
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):  # the kernel and the helpers it shares
        digest.update(path.read_bytes())
    for part in (module, repr(params), cutlass_version, _target_arch()):
        digest.update(part.encode())
    name = f"{module}_{digest.hexdigest()[:20]}"
    cached = _cache_dir() / f"{name}.o"
    start = time.perf_counter()
    if cached.exists():
        try:
            kernel = getattr(load_module(str(cached)), name)
            logger.info("loaded %s %s from %s in %.3f s", module, params, cached, time.perf_counter() - start)
            return kernel
        except Exception as error:  # a truncated or foreign file: compile again and replace it
            logger.warning("ignoring unreadable kernel cache file %s: %s", cached, error)
    kernel = source.compile_kernel(params)
    logger.info("compiled %s %s in %.2f s", module, params, time.perf_counter() - start)
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


def _stream():
    """torch's current stream, so the kernels run in order with torch ops and inside CUDA graph capture."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def proxy_block_scores(
    index_q: torch.Tensor, proxy_cache: torch.Tensor, batch: PagedBatch, shape: MSAShape
) -> torch.Tensor:
    """Same contract as kernels.reference.proxy_block_scores, for bf16 inputs on a CUDA device.

    Batches with a request of PREFILL_TILE_TOKENS or more query tokens run the warpgroup-MMA prefill
    kernel (all of their tokens, in 64-token tiles); others the SIMT decode kernel.
    """
    from kernels.cute.proxy_scores import ProxyScoreParams
    from kernels.cute.proxy_scores_prefill import PrefillProxyScoreParams

    prefill = (prefill_proxy_scores_supported(shape.index_head_dim, shape.block_size)
               and batch.max_query_len >= PREFILL_TILE_TOKENS)
    size = (batch.num_tokens, shape.num_index_heads, batch.block_table.shape[1])
    index_shape = (shape.num_index_heads, shape.num_index_key_heads, shape.index_head_dim, shape.block_size)
    queries = (_cute(index_q.contiguous(), rows16=True), _cute(proxy_cache, rows16=True),
               _cute(batch.block_table.to(torch.int32)))
    positions = _cute(batch.positions)
    if prefill:
        out = torch.full(size, float("-inf"), dtype=torch.float32, device=index_q.device)
        tiles = batch.request_tiles(PREFILL_TILE_TOKENS)
        kernel = compiled_kernel("proxy_scores_prefill", PrefillProxyScoreParams(*index_shape))
        kernel(*queries, positions, _cute(tiles), _cute(out), _stream())
    else:
        out = torch.empty(size, dtype=torch.float32, device=index_q.device)
        kernel = compiled_kernel("proxy_scores", ProxyScoreParams(*index_shape))
        kernel(*queries, _cute(batch.token_requests), positions, _cute(out), _stream())
    return out


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, shape: MSAShape) -> torch.Tensor:
    """Same contract as kernels.reference.topk_blocks, for fp32 scores on a CUDA device; ties go to
    the lower block number."""
    from kernels.cute.topk_blocks import TopkBlocksParams

    num_tokens, num_heads, _ = scores.shape
    out = torch.empty((num_tokens, num_heads, shape.topk_blocks), dtype=torch.int32, device=scores.device)
    if num_tokens == 0:
        return out
    params = TopkBlocksParams(shape.topk_blocks, shape.local_blocks, shape.init_blocks, shape.block_size)
    kernel = compiled_kernel("topk_blocks", params)
    kernel(_cute(scores.contiguous().view(torch.int32)), _cute(positions.to(torch.int32)), _cute(out), _stream())
    return out


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    kernel: str | None = None,
    max_union: int | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.sparse_attention, for bf16 inputs on a CUDA device.

    kv_cache must be contiguous; q and out may be strided views. kernel: "prefill"
    (sparse_attn_prefill.py: tiles of consecutive tokens on wgmma, and the per-token kernel for the
    tiles whose union of blocks exceeds max_union, default PREFILL_MAX_UNION x K per token) or
    "per_token" (sparse_attn.py: one token per CTA, split-K for decode). By default prefill when a
    request brings a whole tile of new tokens (prefill) and the kernel serves the shape.
    splits: the per-token kernel's split-K CTAs per (token, head tile), chosen by
    sparse_attn.num_splits unless given (benchmarks sweep it).
    """
    from kernels.cute.combine import CombineParams
    from kernels.cute.sparse_attn import SparseAttentionParams, num_splits, resident_ctas_per_sm
    from kernels.cute.sparse_attn_prefill import PrefillAttentionParams

    num_tokens, hq, d = batch.num_tokens, shape.num_q_heads, shape.head_dim
    result = out if out is not None and out.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    topk = selected.shape[-1]
    if kernel is None:
        supported = prefill_attention_supported(hq, shape.num_index_heads, d, shape.block_size)
        kernel = "prefill" if supported and batch.max_query_len >= prefill_tile_tokens(shape) else "per_token"
    # converted once: the prefill kernel and the per-token kernel for the tiles it leaves share them
    q_, kv_, table, lens, positions, selected_ = (
        _cute(q.contiguous(), rows16=True), _cute(kv_cache, rows16=True),
        *(_cute(t) for t in (batch.block_table.to(torch.int32), batch.seq_lens.to(torch.int32), batch.positions,
                             selected.to(torch.int32).contiguous())),
    )
    handled = None
    if kernel == "prefill":
        tiled = PrefillAttentionParams(hq, shape.num_kv_heads, shape.num_index_heads, d, topk, shape.block_size)
        if max_union is None:
            max_union = round(PREFILL_MAX_UNION * tiled.tokens_per_tile * topk)
        handled = torch.empty((num_tokens, shape.num_index_heads), dtype=torch.int32, device=q.device)
        compiled_kernel("sparse_attn_prefill", tiled)(
            q_, kv_, table, lens, positions, selected_, _cute(batch.request_tiles(tiled.tokens_per_tile)),
            _cute(result, rows16=True), _cute(handled), max_union, scale, _stream(),
        )
        if max_union >= tiled.candidates:  # every tile was served
            return _into(result, out)
        splits = 1
    params = SparseAttentionParams(hq, shape.num_kv_heads, shape.num_index_heads, d, shape.block_size,
                                   gated=handled is not None)
    if splits is None:
        splits, per_split = num_splits(num_tokens, params, topk, resident_ctas_per_sm(params) * _num_sms(q.device.index or 0))
    else:
        per_split = -(-topk // splits)
        splits = -(-topk // per_split)
    inputs = (q_, kv_, table, lens, _cute(batch.token_requests), positions, selected_)
    lse = torch.empty((splits, num_tokens, hq), dtype=torch.float32, device=q.device)
    if splits == 1:
        attend = compiled_kernel("sparse_attn", params)
        attend(*inputs, _cute(result.view(1, num_tokens, hq, d), rows16=True), _cute(lse),
               None if handled is None else _cute(handled), scale, per_split, _stream())
    else:
        attend = compiled_kernel("sparse_attn", dataclasses.replace(params, split=True))
        partial = torch.empty((splits, num_tokens, hq, d), dtype=torch.float32, device=q.device)
        attend(*inputs, _cute(partial, rows16=True), _cute(lse), None, scale, per_split, _stream())
        compiled_kernel("combine", CombineParams(hq, d))(_cute(partial, rows16=True), _cute(lse), _cute(result, rows16=True), _stream())
    return _into(result, out)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The kernel's contiguous result, copied into the caller's strided `out` where it was not written in place."""
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
