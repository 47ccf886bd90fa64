"""Random paged MSA problems for tests and benchmarks: caches, block tables, queries.

Pages are handed out in random order and every slot that no request owns (free pages, the tail of
each request's last page) is filled with NaN, so an implementation that reads outside a request's
visible tokens poisons its output.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from msa_kernels import reference
from msa_kernels.plan import StepPlan
from msa_kernels.shapes import MSAShape, PagedBatch


def small_shape(**overrides) -> MSAShape:
    """A small MSA layer shape for CPU tests (16-token blocks, top-3, 8 query heads in 2 KV groups), with
    any field replaced."""
    base = dict(
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        num_index_heads=2,
        num_index_key_heads=1,
        index_head_dim=8,
        topk_blocks=3,
        block_size=16,
    )
    return MSAShape(**(base | overrides))


class LayerCheck(NamedTuple):
    """PagedCase.layer_against_reference's result."""

    selection_equal: bool
    cosine: float
    rel_err: float
    reference_selection: torch.Tensor  # [T, Hi, K], the blocks the reference selects


@dataclass
class PagedCase:
    shape: MSAShape
    batch: PagedBatch
    q: torch.Tensor  # [T, Hq, D]
    index_q: torch.Tensor  # [T, Hi, Dp]
    kv_cache: torch.Tensor  # [pages, 2, B, Hkv, D]
    index_key_cache: torch.Tensor  # [pages, B, Hki, Dp]
    scale: float

    @cached_property
    def plan(self) -> StepPlan:
        """The batch's step plan (StepPlan.of), made once as vLLM's builder makes a step's: msa_kernels.ops takes it."""
        return StepPlan.of(self.batch)

    def request_tokens(self, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
        """Request r's contiguous K, V, index keys [seq_len, heads, dim] and its query token slice."""
        b = self.shape.block_size
        seq_len = self.batch.seq_lens_cpu[r]
        pages = self.batch.block_table[r, : -(-seq_len // b)].long()
        kv = self.kv_cache[pages]
        keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[:seq_len]
        values = kv[:, 1].reshape(-1, *kv.shape[-2:])[:seq_len]
        index_keys = self.index_key_cache[pages].reshape(-1, *self.index_key_cache.shape[-2:])[:seq_len]
        q0, q1 = self.batch.query_start_loc_cpu[r], self.batch.query_start_loc_cpu[r + 1]
        return keys, values, index_keys, slice(q0, q1)

    def reference_selection(self) -> torch.Tensor:
        """The blocks [T, Hi, K] the reference selects for the case's queries, from float32 index scores."""
        scores = reference.index_block_scores(
            self.index_q.float(), self.index_key_cache.float(), self.batch, self.shape
        )
        return reference.topk_blocks(scores, self.batch.positions, self.shape)

    def layer_against_reference(self) -> LayerCheck:
        """msa_kernels.ops.msa_attention on the case, into an output filled with NaN first, against the reference's
        selection and its float32 attention output."""
        from msa_kernels import ops  # ops is what this checks; the rest of this module needs only the reference

        out, selected = ops.msa_attention(
            self.q,
            self.index_q,
            self.kv_cache,
            self.index_key_cache,
            self.plan,
            self.shape,
            self.scale,
            out=torch.full_like(self.q, float("nan")),
        )
        want_selected = self.reference_selection()
        want = reference.sparse_attention(
            self.q.float(), self.kv_cache.float(), self.batch, want_selected, self.shape, self.scale
        )
        cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), want.flatten(), dim=0).item()
        rel_err = ((out.float() - want).norm() / want.norm()).item()
        return LayerCheck(torch.equal(selected, want_selected), cosine, rel_err, want_selected)

    def dense_causal(self, r: int) -> torch.Tensor:
        """Plain causal GQA attention of request r's queries over its whole context, [q_len, Hq, D] float64."""
        keys, values, _, tokens = self.request_tokens(r)
        seq_len, q_len = keys.shape[0], tokens.stop - tokens.start
        group = self.shape.num_q_heads // self.shape.num_kv_heads
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, D]
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = self.q[tokens].double().transpose(0, 1)  # [Hq, T, D]
        pos = torch.arange(seq_len - q_len, seq_len, device=keys.device)[:, None]
        mask = torch.arange(seq_len, device=keys.device)[None, :] <= pos
        s = (q @ k.transpose(1, 2)) * self.scale
        return (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1)


def bound_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor vLLM binds to a layer behind a K/V cache view [pages, 2, B, Hkv, D] of reference.new_kv_cache's
    layout: [pages, Hkv, B, 2 * D] (reference.kv_planes' inverse, a view)."""
    return kv_cache.permute(0, 3, 2, 1, 4).flatten(-2)


def make_case(
    shape: MSAShape,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
) -> PagedCase:
    """A batch where request r has seq_lens[r] tokens, the last q_lens[r] of them being queries."""
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = shape.block_size
    blocks = [-(-s // b) for s in seq_lens]
    num_pages = sum(blocks) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(seq_lens), max(1, max(blocks)), dtype=torch.int32)
    kv_cache = reference.new_kv_cache(num_pages, shape, dtype, fill=float("nan"))
    index_key_cache = torch.full(
        (num_pages, b, shape.num_index_key_heads, shape.index_head_dim), float("nan"), dtype=dtype
    )
    used = 0
    for r, (n_blk, seq_len) in enumerate(zip(blocks, seq_lens)):
        pages = order[used : used + n_blk]
        used += n_blk
        table[r, :n_blk] = pages.int()
        for i, page in enumerate(pages.tolist()):
            n = min(b, seq_len - i * b)
            kv_cache[page, :, :n] = torch.randn(2, n, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
            index_key_cache[page, :n] = torch.randn(n, shape.num_index_key_heads, shape.index_head_dim, generator=g).to(
                dtype
            )
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, shape.num_q_heads, shape.head_dim, generator=g).to(dtype)
    index_q = torch.randn(num_tokens, shape.num_index_heads, shape.index_head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    batch = PagedBatch(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
    )
    return PagedCase(
        shape=shape,
        batch=batch,
        q=q.to(device),
        index_q=index_q.to(device),
        kv_cache=kv_cache.to(device),  # .to keeps the strides of vLLM's layout
        index_key_cache=index_key_cache.to(device),
        scale=shape.head_dim**-0.5,
    )
