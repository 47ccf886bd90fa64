"""MSA in plain PyTorch on paged caches: the function every kernel must compute, and the CPU path.

Three steps, as in docs/MSA_SPEC.md (msa_kernels.ops.msa_attention composes them), each for any
batch (decode, prefill or a mix of both):
  index_block_scores  index queries x paged index keys, causal, max-pooled per block
  topk_blocks         top-k blocks per (token, index head), local/init blocks forced, -1 padded
  sparse_attention    exact-softmax GQA attention over the selected blocks of the paged K/V cache

Layouts (vLLM's, page size == block size B):
  index_key_cache [num_pages, B, Hki, Dp]      kv_cache [num_pages, 2, B, Hkv, D]   (K at [:, 0], V at [:, 1]):
  kv_planes' view of the cache vLLM allocates, [num_pages, Hkv, B, 2 * D] (a head's K and V of a token side by
  side, as vLLM's FlashAttention and MiniMax-M3 backends hold it); new_kv_cache makes one
  or an FP8 index-key cache (msa_kernels.fp8_index_keys: e4m3 pages with per-token float32 scales), scored
  as FP8 MMAs score it: keys dequantised (e4m3 x scale), index queries rounded to FP8 the same way.
  An FP8 K/V cache is vLLM's (--kv-cache-dtype fp8): uint8 storage of the e4m3 values of K / k_scale and
  V / v_scale, one float scale per tensor (kv_scales = (k_scale, v_scale)), written saturated at +-448 as vLLM's
  cache op writes them; sparse_attention reads them back as e4m3 x scale.
Selections hold logical block numbers of the request (not page ids), ascending, -1 at the end.

Work is vectorised per request and per chunk of query tokens (bounded memory); the only Python
loops are over requests and query chunks. Arithmetic runs in float32, or float64 for float64 inputs.
"""

import torch

from msa_kernels.fp8_index_keys import E4M3_MAX, Fp8IndexKeyCache, quantize_rows, round_trip
from msa_kernels.shapes import MSAShape, PagedBatch

FP8_KV_STORAGE = torch.uint8  # how vLLM allocates an FP8 K/V cache; the bytes are torch.float8_e4m3fn values

# Upper bound on elements of one [query chunk, heads, keys] score tile.
_TILE_ELEMENTS = 1 << 23


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def is_fp8_kv(kv_cache: torch.Tensor) -> bool:
    """Whether a K/V cache (or one of its K or V views) is an FP8 cache as vLLM allocates it."""
    return kv_cache.dtype == FP8_KV_STORAGE


def _query_chunks(q_start: int, q_end: int, heads: int, keys: int):
    step = max(1, _TILE_ELEMENTS // max(1, heads * keys))
    for start in range(q_start, q_end, step):
        yield start, min(q_end, start + step)


def _request_pages(batch: PagedBatch, r: int, block_size: int) -> tuple[torch.Tensor, int]:
    seq_len = batch.seq_lens_cpu[r]
    num_blocks = -(-seq_len // block_size)
    return batch.block_table[r, :num_blocks].long(), num_blocks


def index_block_scores(
    index_q: torch.Tensor, index_key_cache: torch.Tensor | Fp8IndexKeyCache, batch: PagedBatch, shape: MSAShape
) -> torch.Tensor:
    """Max-pooled causal index scores, [T, Hi, max_blocks]; -inf where a block has no visible key.

    With an FP8 index-key cache: the scores of the FP8-rounded index queries (fp8_index_keys.round_trip, per
    token and index head) against the dequantised keys, in float32.
    """
    num_tokens, max_blocks = batch.num_tokens, batch.block_table.shape[1]
    hki, group, bs = shape.num_index_key_heads, shape.index_heads_per_key_head, shape.block_size
    fp8 = isinstance(index_key_cache, Fp8IndexKeyCache)
    if fp8:
        index_q = round_trip(index_q)
    dtype = _compute_dtype(index_q)
    out = index_q.new_full((num_tokens, shape.num_index_heads, max_blocks), float("-inf"), dtype=dtype)
    positions = batch.positions
    for r in range(batch.num_requests):
        pages, num_blocks = _request_pages(batch, r, bs)
        if num_blocks == 0:
            continue
        if isinstance(index_key_cache, Fp8IndexKeyCache):
            keys = index_key_cache.dequantize(pages)
        else:
            keys = index_key_cache[pages].to(dtype)
        keys = keys.reshape(num_blocks * bs, hki, shape.index_head_dim)
        key_pos = torch.arange(num_blocks * bs, device=keys.device)
        q0, q1 = batch.query_start_loc_cpu[r], batch.query_start_loc_cpu[r + 1]
        for c0, c1 in _query_chunks(q0, q1, shape.num_index_heads, num_blocks * bs):
            q = index_q[c0:c1].to(dtype).view(c1 - c0, hki, group, shape.index_head_dim)
            s = torch.einsum("tkgd,nkd->tkgn", q, keys).reshape(c1 - c0, shape.num_index_heads, -1)
            hidden = key_pos[None, :] > positions[c0:c1, None]
            s = s.masked_fill(hidden[:, None, :], float("-inf"))
            out[c0:c1, :, :num_blocks] = s.view(c1 - c0, shape.num_index_heads, num_blocks, bs).amax(-1)
    return out


def topk_blocks(
    scores: torch.Tensor, positions: torch.Tensor, shape: MSAShape, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Top-k logical blocks per (token, index head), [T, Hi, K] int32, ascending, -1 padded (into out if given).

    The local blocks (the query's block and the local_blocks-1 before it) and the init blocks are
    always taken; the other slots take the best-scoring visible blocks, the lower block number first
    among equal scores.
    """
    num_tokens, num_heads, max_blocks = scores.shape
    k = shape.topk_blocks
    query_block = (positions // shape.block_size).long()[:, None]
    block = torch.arange(max_blocks, device=scores.device)[None, :]
    visible = block <= query_block
    forced = visible & ((block > query_block - shape.local_blocks) | (block < shape.init_blocks))
    ranked = scores.masked_fill(forced[:, None, :], float("inf")).masked_fill(~visible[:, None, :], float("-inf"))
    top_scores, top_blocks = ranked.sort(dim=-1, descending=True, stable=True)
    top_scores, top_blocks = top_scores[..., :k], top_blocks[..., :k]
    missing = top_scores == float("-inf")
    top_blocks = top_blocks.masked_fill(missing, max_blocks).sort(dim=-1).values
    top_blocks = top_blocks.masked_fill(top_blocks == max_blocks, -1).to(torch.int32)
    if top_blocks.shape[-1] < k:
        pad = top_blocks.new_full((num_tokens, num_heads, k - top_blocks.shape[-1]), -1)
        top_blocks = torch.cat([top_blocks, pad], dim=-1)
    if out is not None:
        return out.copy_(top_blocks)
    return top_blocks


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Exact-softmax causal GQA attention over the selected blocks only, [T, Hq, D] in q's dtype.

    selected: [T, Hi, K] logical blocks (-1 = empty slot); main head g reads index head g // m's
    blocks and KV head g // (Hq / Hkv). kv_scales: (k_scale, v_scale) of an FP8 K/V cache (is_fp8_kv).
    """
    num_tokens, hq, d = batch.num_tokens, shape.num_q_heads, shape.head_dim
    hkv, bs = shape.num_kv_heads, shape.block_size
    dtype = _compute_dtype(q)
    if out is None:
        out = q.new_empty((num_tokens, hq, d))
    positions = batch.positions
    for r in range(batch.num_requests):
        pages, num_blocks = _request_pages(batch, r, bs)
        q0, q1 = batch.query_start_loc_cpu[r], batch.query_start_loc_cpu[r + 1]
        for c0, c1 in _query_chunks(q0, q1, hq, num_blocks * bs):
            n = c1 - c0
            sel = selected[c0:c1].long()
            # Read only the blocks some token of the chunk selected: column u of `used` is block used[u].
            used = torch.unique(sel[sel >= 0])
            column = torch.full((num_blocks + 1,), len(used), dtype=torch.long, device=sel.device)
            column[used] = torch.arange(len(used), device=sel.device)
            block_mask = torch.zeros(n, shape.num_index_heads, len(used) + 1, dtype=torch.bool, device=sel.device)
            block_mask.scatter_(2, column[torch.where(sel < 0, num_blocks, sel)], True)
            kv = _read_kv(kv_cache[pages[used]], dtype, kv_scales)  # [u, 2, B, Hkv, D]
            key_pos = (used[:, None] * bs + torch.arange(bs, device=sel.device)).flatten()
            keys = kv[:, 0].reshape(-1, hkv, d)
            # The last page's slots past seq_len hold stale data: zero them so 0-weight * NaN cannot leak.
            stale = (key_pos >= batch.seq_lens_cpu[r])[:, None, None]
            values = kv[:, 1].reshape(-1, hkv, d).masked_fill(stale, 0)
            token_mask = block_mask[..., : len(used)].repeat_interleave(shape.heads_per_index_head, dim=1)
            token_mask = token_mask.repeat_interleave(bs, dim=2)  # [n, Hq, keys]
            token_mask &= (key_pos[None, :] <= positions[c0:c1, None])[:, None, :]
            qc = q[c0:c1].to(dtype).view(n, hkv, hq // hkv, d)
            s = torch.einsum("tkgd,nkd->tkgn", qc, keys).reshape(n, hq, -1) * scale
            p = torch.softmax(s.masked_fill(~token_mask, float("-inf")), dim=-1)
            o = torch.einsum("tkgn,nkd->tkgd", p.view(n, hkv, hq // hkv, -1), values)
            out[c0:c1] = o.reshape(n, hq, d).to(out.dtype)
    return out


def kv_planes(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's K/V cache [num_pages, Hkv, B, 2 * D] as the view [num_pages, 2, B, Hkv, D] (K at [:, 0], V at [:, 1])
    that the kernels and this module read."""
    return kv_cache.unflatten(-1, (2, kv_cache.shape[-1] // 2)).permute(0, 3, 2, 1, 4)


def new_kv_cache(
    num_pages: int, shape: MSAShape, dtype: torch.dtype, device: str | torch.device = "cpu", fill: float = 0.0
) -> torch.Tensor:
    """A K/V cache laid out as vLLM allocates it, filled with `fill`, as kv_planes' view [num_pages, 2, B, Hkv, D]."""
    cache = torch.full(
        (num_pages, shape.num_kv_heads, shape.block_size, 2 * shape.head_dim), fill, dtype=dtype, device=device
    )
    return kv_planes(cache)


def _read_kv(pages: torch.Tensor, dtype: torch.dtype, kv_scales: tuple[float, float]) -> torch.Tensor:
    """K/V pages [u, 2, B, Hkv, D] in dtype: FP8 ones dequantised (e4m3 x k_scale, x v_scale)."""
    if not is_fp8_kv(pages):
        return pages.to(dtype)
    kv = pages.view(torch.float8_e4m3fn).to(dtype)
    return kv * torch.tensor(kv_scales, dtype=dtype, device=kv.device).view(1, 2, 1, 1, 1)


def write_paged(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, fp8_scale: float = 1.0) -> None:
    """Store per-token rows into a paged cache [num_pages, B, ...] at flat slots; slots < 0 are skipped.

    cache may be a strided view (e.g. kv_cache[:, 0]); values holds at least len(slot_mapping) rows. An FP8 K/V
    cache (is_fp8_kv) gets the e4m3 values of values / fp8_scale, saturated at +-448.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    rows = values[: slot_mapping.shape[0]][keep]
    if is_fp8_kv(cache):
        rows = (rows.float() / fp8_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(FP8_KV_STORAGE)
    cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)


def fp8_kv_cache(kv_cache: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """A whole K/V cache [pages, 2, B, Hkv, D] as vLLM's FP8 cache holds it (laid out as new_kv_cache's): every slot
    written by write_paged."""
    pages, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    fp8 = kv_planes(
        torch.zeros(pages, num_kv_heads, block_size, 2 * head_dim, dtype=FP8_KV_STORAGE, device=kv_cache.device)
    )
    slots = torch.arange(kv_cache.shape[0] * kv_cache.shape[2], device=kv_cache.device)
    for i, scale in enumerate(kv_scales):
        write_paged(fp8[:, i], slots, kv_cache[:, i].flatten(0, 1), fp8_scale=scale)
    return fp8


def write_index_keys(
    index_key_cache: torch.Tensor | Fp8IndexKeyCache, slot_mapping: torch.Tensor, index_keys: torch.Tensor
) -> None:
    """Store per-token index keys [T, Hki, Dp] at flat slots (< 0: skipped); an FP8 cache gets them quantised
    per (token, index-key head), values and scales."""
    if not isinstance(index_key_cache, Fp8IndexKeyCache):
        write_paged(index_key_cache, slot_mapping, index_keys)
        return
    values, scales = quantize_rows(index_keys[: slot_mapping.shape[0]])
    write_paged(index_key_cache.values, slot_mapping, values)
    write_paged(index_key_cache.scales, slot_mapping, scales)
