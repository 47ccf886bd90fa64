"""CuTeDSL kernel (sm_90a): prefill sparse attention block by block, for tokens that select independently.

Computes reference.sparse_attention for prefill tokens with the loops turned around: instead of a tile of
tokens reading the blocks they selected (sparse_attn_prefill.py, whose tiles pay 64 MMA rows for every block
of their union, and sparse_attn.py, which reads a token's 16 blocks for its 16 rows), a CTA takes one K/V
page and attends every (token, index head) that selected it against that page while it sits in shared memory:
the page's K and V are read once for up to `tokens_per_item` tokens, whose query rows are gathered instead (a
token's m = Hq / Hi query heads of that index head are one contiguous run of q). Each such attention over one
block is a partial result (its output normalised over the block's keys, and their log-sum-exp), written per
selection slot; combine.py merges a token's K slots into its output as it merges split-K partials. Where
neighbouring tokens share their blocks, sparse_attn_prefill.py reads less: this kernel is for the selections
that look random, where that one leaves most tiles to the per-token kernel.

block_major_items (PyTorch, on the device, no host sync) sorts the selections' (token, index head, slot)
entries by (request, index head, block) and cuts each run of one block into work items of at most
tokens_per_item entries. The kernel is persistent: CTA c takes items c, c + CTAs, ... up to the count the sort
left on the device. Per item: TMA brings the page's K and V tiles (128 keys x D) once; then per group of
tokens_per_group = 64 / m tokens (64 MMA rows: 4 tokens of MiniMax-M3): their query rows by cp.async (the next
group's while this one computes), S = Q K^T (wgmma), the causal mask (only where the page is a token's own
block), softmax over the page's keys, O = P V (wgmma), O / row sum stored in bf16 with the log-sum-exp. V rows
past the request's length are zeroed in shared memory (stale slots, NaN in the tests, never reach the MMA).

Serving runs sparse_attn_prefill.py; bench_sparse_attention.py's prefill table and sweep_prefill_attention.py
time this one beside it.
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync

from msa_kernels.cute.combine import combine_splits
from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel, contiguous_out, copy_into, num_sms
from msa_kernels.cute.sparse_attn import attention_inputs
from msa_kernels.cute.warp_mma import acc_rows_cols, online_softmax_row, quad_reduce, warpgroup_gemm_nt
from msa_kernels.cute.warpgroup_attention import (
    LOG2_E,
    ROWS,
    WARPGROUP,
    attention_mmas,
    gemm_pv,
    kv_cache_tma,
    page_tiles,
    probabilities,
    query_row_copy,
    smem_atom,
    transposed_pages,
    zero_rows_past,
)
from msa_kernels.shapes import MSAShape, PagedBatch

CTAS_PER_SM = 2  # shared memory (two Q stages and one page: ~97 KB) lets two share an SM; one warpgroup each


@dataclass(frozen=True)
class BlockMajorParams:
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    num_index_heads: int  # Hi
    head_dim: int  # D
    topk_blocks: int  # K: selection slots per (token, index head), the partials a token's output merges
    block_size: int = 128  # B: tokens per block == per page

    @property
    def heads_per_index_head(self) -> int:
        return self.num_q_heads // self.num_index_heads

    @property
    def tokens_per_group(self) -> int:
        return ROWS // self.heads_per_index_head


class BlockMajorAttentionKernel:
    def __init__(self, params: BlockMajorParams):
        assert self.can_implement(
            torch.bfloat16, params.num_q_heads, params.num_index_heads, params.head_dim, params.block_size
        )
        assert params.num_index_heads % params.num_kv_heads == 0
        self.p = params

    @classmethod
    def can_implement(
        cls, dtype: torch.dtype, num_q_heads: int, num_index_heads: int, head_dim: int, block_size: int
    ) -> bool:
        """bf16 queries and K/V, 128-token blocks, head dim 64 or 128, m = Hq / Hi query heads per index head
        dividing 64 in whole row steps of the query copy (8 rows of D 128, 16 of D 64)."""
        m = num_q_heads // num_index_heads
        if dtype != torch.bfloat16 or block_size != 128 or head_dim not in (64, 128):
            return False
        return ROWS % m == 0 and m % (WARPGROUP * 8 // head_dim) == 0

    @staticmethod
    def fake_arguments(params: BlockMajorParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        return (
            row_major(bf16, 3, align=16),  # q
            row_major(bf16, 5, align=16),  # kv_cache
            row_major(i32, 2),  # block_table
            row_major(i32, 1),  # seq_lens
            row_major(i32, 1),  # token_request
            row_major(i32, 1),  # token_position
            row_major(i32, 3),  # selected
            row_major(i32, 1),  # entry_order
            row_major(i32, 1),  # item_first
            row_major(i32, 1),  # item_count
            row_major(bf16, 4, align=16),  # partial_out
            row_major(cutlass.Float32, 3),  # partial_lse
            cutlass.Float32(1.0),  # scale
            cutlass.Int32(1),  # ctas
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [T, Hq, D] bf16
        kv_cache: cute.Tensor,  # [pages, 2, B, Hkv, D] bf16
        block_table: cute.Tensor,  # [R, max_blocks] int32
        seq_lens: cute.Tensor,  # [R] int32
        token_request: cute.Tensor,  # [T] int32
        token_position: cute.Tensor,  # [T] int32
        selected: cute.Tensor,  # [T, Hi, K] int32 logical blocks, -1 padded
        entry_order: cute.Tensor,  # [T Hi K] int32: flat (token, index head, slot) entries, sorted by block
        item_first: cute.Tensor,  # [T Hi K + 1] int32: item w's entries are [item_first[w], item_first[w + 1])
        item_count: cute.Tensor,  # [1] int32: the items
        partial_out: cute.Tensor,  # [K, T, Hq, D] bf16 out: per slot, the output over that block's keys
        partial_lse: cute.Tensor,  # [K, T, Hq] fp32 out: and its log-sum-exp (slots nobody writes: -inf)
        scale: cutlass.Float32,
        ctas: cutlass.Int32,  # persistent CTAs
        stream: cuda.CUstream,
    ):
        p = self.p
        bf16 = cutlass.BFloat16
        q_layout = cute.tile_to_shape(smem_atom(), (ROWS, p.head_dim, 2), (0, 1, 2))  # two groups' query rows
        kv_layout = cute.tile_to_shape(smem_atom(), (p.block_size, p.head_dim, 1), (0, 1, 2))  # one page
        tma_atom, tma_kv = kv_cache_tma(kv_cache, kv_layout, p.block_size, p.head_dim)
        mma_qk, mma_pv = attention_mmas(p.block_size, p.head_dim)
        row_copy = query_row_copy(p.head_dim)

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, 1]  # TMA arrival of the item's page
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]

        self.kernel(
            q,
            tma_kv,
            block_table,
            seq_lens,
            token_request,
            token_position,
            selected,
            entry_order,
            item_first,
            item_count,
            partial_out,
            partial_lse,
            scale * LOG2_E,
            scale,
            tma_atom,
            mma_qk,
            mma_pv,
            row_copy,
            q_layout,
            kv_layout,
            Storage,
        ).launch(grid=[ctas, 1, 1], block=[WARPGROUP, 1, 1], smem=Storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        tma_kv: cute.Tensor,
        block_table: cute.Tensor,
        seq_lens: cute.Tensor,
        token_request: cute.Tensor,
        token_position: cute.Tensor,
        selected: cute.Tensor,
        entry_order: cute.Tensor,
        item_first: cute.Tensor,
        item_count: cute.Tensor,
        partial_out: cute.Tensor,
        partial_lse: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        tma_atom: cute.CopyAtom,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        row_copy: cute.TiledCopy,
        q_layout: cute.ComposedLayout,
        kv_layout: cute.ComposedLayout,
        Storage: cutlass.Constexpr,
    ):
        p = self.p
        f32 = cutlass.Float32
        m, g_max, k_max = p.heads_per_index_head, p.tokens_per_group, p.topk_blocks
        entries_per_token = p.num_index_heads * k_max
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tx_bytes = 2 * p.block_size * p.head_dim * 2  # the K and V tiles, bf16

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        full = storage.full.data_ptr()
        # wgmma takes affine shared-memory layouts: the swizzle goes into the pointer.
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sVt = transposed_pages(sV, p.block_size, p.head_dim, 1)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(full, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        gKV = cute.local_tile(
            tma_kv[None, None, None, None, None], (p.block_size, p.head_dim), (0, 0, None, None, None)
        )
        tKs, tVs, tKVg = page_tiles(tma_atom, gKV, sK, sV)
        thr_copy = row_copy.get_slice(tidx)
        thr_qk = mma_qk.get_slice(tidx)
        thr_pv = mma_pv.get_slice(tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrVt = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        score_coords = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((ROWS, p.block_size))))
        out_coords = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((ROWS, p.head_dim))))
        tVc = thr_copy.partition_D(cute.make_identity_tensor((p.block_size, p.head_dim)))
        rows = cute.size(score_coords, mode=[0])

        items = item_count[0]
        page_loads = cutlass.Int32(0)
        for item in cutlass.range(cta, items, num_ctas, unroll=1):
            first = item_first[item]
            end = item_first[item + 1]
            lead = entry_order[first]  # every entry of the item: the same request, index head and block
            lead_token = lead // entries_per_token
            index_head = (lead // k_max) % p.num_index_heads
            request = token_request[lead_token]
            block = selected[lead_token, index_head, lead % k_max]
            first_key = block * p.block_size
            seq_len = seq_lens[request]
            kv_head = index_head * m // (p.num_q_heads // p.num_kv_heads)
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(full, tx_bytes)
                page = block_table[request, block]
                cute.copy(tma_atom, tKVg[None, kv_head, 0, page], tKs[None, 0], tma_bar_ptr=full)
                cute.copy(tma_atom, tKVg[None, kv_head, 1, page], tVs[None, 0], tma_bar_ptr=full)

            num_groups = (end - first + g_max - 1) // g_max
            self.load_queries(q, entry_order, row_copy, thr_copy, sQ, first, end, 0, 0, index_head)
            cute.arch.cp_async_commit_group()
            cute.arch.mbarrier_wait(full, page_loads % 2)
            page_loads += 1
            valid_keys = seq_len - first_key  # V rows past the request (its last page) are zeroed
            if valid_keys < p.block_size:
                zero_rows_past(thr_copy, sV[None, None, 0], tVc, valid_keys)

            for group in cutlass.range(num_groups, unroll=1):
                stage = group % 2
                if group + 1 < num_groups:  # the next group's rows load while this one computes
                    self.load_queries(
                        q, entry_order, row_copy, thr_copy, sQ, first, end, group + 1, 1 - stage, index_head
                    )
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                cute.arch.fence_view_async_shared()  # generic-proxy writes, then read by wgmma (async proxy)
                cute.arch.sync_threads()

                # This thread's rows: token j of the group (row = j m + head), its entry, position and slot.
                row_entry = cute.make_rmem_tensor((rows,), cutlass.Int32)  # -1: past the item's entries
                row_position = cute.make_rmem_tensor((rows,), cutlass.Int32)
                for r in cutlass.range_constexpr(rows):
                    entry_index = first + group * g_max + score_coords[r, 0][0] // m
                    row_entry[r] = -1
                    row_position[r] = -1
                    if entry_index < end:
                        row_entry[r] = entry_order[entry_index]
                        row_position[r] = token_position[row_entry[r] // entries_per_token]

                # S = Q K^T over the head dim
                acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, p.block_size)), f32)
                warpgroup_gemm_nt(mma_qk, acc_s, tSrQ[None, None, None, stage], tSrK, 0)

                # Causal mask where the page is the token's own block, softmax over the page's keys.
                acc_s_mn = acc_rows_cols(acc_s)
                acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, p.head_dim)), f32)
                acc_o.fill(0.0)
                acc_o_mn = acc_rows_cols(acc_o)
                row_max = cute.make_rmem_tensor((rows,), f32)
                row_sum = cute.make_rmem_tensor((rows,), f32)
                row_max.fill(-f32.inf)
                row_sum.fill(0.0)
                for r in cutlass.range_constexpr(rows):
                    if first_key + p.block_size - 1 > row_position[r]:
                        for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                            if first_key + score_coords[r, c][1] > row_position[r]:
                                acc_s_mn[r, c] = -f32.inf
                    online_softmax_row(acc_s_mn, acc_o_mn, row_max, row_sum, r, scale_log2)
                tOrP = probabilities(thr_pv, acc_s, ROWS, p.block_size)
                gemm_pv(mma_pv, acc_o, tOrP, tOrVt[None, None, None, 0])  # O = P V over the page's keys

                # The partial of each row's (token, slot): normalised over the page's keys, and its log-sum-exp.
                for r in cutlass.range_constexpr(rows):
                    total = quad_reduce(row_sum[r], lambda a, b: a + b)
                    if row_entry[r] >= 0:
                        token = row_entry[r] // entries_per_token
                        slot = row_entry[r] % k_max
                        head = index_head * m + out_coords[r, 0][0] % m
                        inv = 0.0 if total == 0.0 else cute.arch.rcp_approx(total)
                        for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                            partial_out[slot, token, head, out_coords[r, c][1]] = (acc_o_mn[r, c] * inv).to(
                                cutlass.BFloat16
                            )
                        if tidx % 4 == 0:
                            lse = -f32.inf
                            if total > 0.0:
                                lse = row_max[r] * scale + cute.math.log(total, fastmath=True)
                            partial_lse[slot, token, head] = lse
                cute.arch.sync_threads()  # every warp is done with this group's rows (and, last, with the page)

    @cute.jit
    def load_queries(self, q, entry_order, row_copy, thr_copy, sQ, first, end, group, stage, index_head):
        """cp.async the query rows of group `group` of the item's entries [first, end) into stage `stage`: token
        j's m heads of index_head are rows [j m, (j + 1) m); rows of tokens past the entries are zeroed."""
        p = self.p
        m = p.heads_per_index_head
        entries_per_token = p.num_index_heads * p.topk_blocks
        for j in cutlass.range_constexpr(p.tokens_per_group):
            rows = cute.local_tile(sQ[None, None, stage], (m, p.head_dim), (j, 0))
            dst = thr_copy.partition_D(rows)
            entry_index = first + group * p.tokens_per_group + j
            if entry_index < end:
                token = entry_order[entry_index] // entries_per_token
                heads = cute.local_tile(
                    cute.domain_offset((index_head * m, 0), q[token, None, None]), (m, p.head_dim), (0, 0)
                )
                cute.copy(row_copy, thr_copy.partition_S(heads), dst)
            else:
                dst.fill(0)


def block_major_items(
    selected: torch.Tensor,
    token_requests: torch.Tensor,
    max_blocks: int,
    tokens_per_item: int,
    handled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The work of BlockMajorAttentionKernel for a selection [T, Hi, K] (-1: no block): (entry_order [T Hi K] int32,
    the flat (token, index head, slot) entries sorted by (request, index head, block), tokens ascending within a
    block, those without a block last; item_first [T Hi K + 1] int32, where item w's entries begin (the ends past
    the last item); item_count [1] int32). An item is a run of at most tokens_per_item entries of one block.
    handled ([T, Hi] int32): the (token, index head)s it marks count as without blocks (another kernel attends
    them). Computed on the device with fixed shapes: no host sync."""
    num_tokens, num_heads, k = selected.shape
    entries = num_tokens * num_heads * k
    device = selected.device
    index = torch.arange(entries, device=device)
    block = selected.reshape(-1).long()
    if handled is not None:
        block = block.masked_fill((handled != 0).repeat_interleave(k, dim=1).reshape(-1), -1)
    request = token_requests[:num_tokens].long()[index // (num_heads * k)]
    head = (index // k) % num_heads
    no_block = torch.iinfo(torch.int64).max
    key = torch.where(block >= 0, (request * num_heads + head) * max_blocks + block, no_block)
    sorted_key, order = torch.sort(key, stable=True)
    run_starts = torch.ones(entries, dtype=torch.bool, device=device)
    run_starts[1:] = sorted_key[1:] != sorted_key[:-1]
    run_first = torch.cummax(torch.where(run_starts, index, 0), dim=0).values
    has_block = sorted_key != no_block
    item_starts = ((index - run_first) % tokens_per_item == 0) & has_block
    item_index = torch.cumsum(item_starts, dim=0) - 1
    item_first = has_block.sum().to(torch.int32).expand(entries + 2).clone()  # past the last item: the end
    item_first.scatter_(0, torch.where(item_starts, item_index, entries + 1), index.to(torch.int32))
    return order.to(torch.int32), item_first[: entries + 1], item_starts.sum().to(torch.int32).view(1)


TOKENS_PER_ITEM = 32  # entries (tokens) of one block a work item attends: the page is read once for them
PARTIAL_BYTES = 1 << 30  # largest partial tensor a call makes at once: longer prefills go in runs of tokens


def prefill_sparse_attention_by_block(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    tokens_per_item: int = TOKENS_PER_ITEM,
    handled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.sparse_attention, for bf16 inputs on Hopper (BlockMajorAttentionKernel
    .can_implement): the kernel writes a partial per (token, query head, selection slot), [K, T, Hq, D] bf16 and its
    log-sum-exp, combine.py merges them into the output. The partials take K x Hq x D x 2 bytes a token (256 KB at
    M3's shapes): where a batch's would pass PARTIAL_BYTES, runs of its tokens go one after the other
    (PagedBatch.token_chunks). kv_cache must be contiguous; q and out may be strided views. handled ([T, Hi] int32,
    the prefill kernel's flags): only the (token, index head) rows it leaves at 0 are attended and written."""
    topk = selected.shape[-1]
    params = BlockMajorParams(
        shape.num_q_heads, shape.num_kv_heads, shape.num_index_heads, shape.head_dim, topk, shape.block_size
    )
    kernel = compiled_kernel(BlockMajorAttentionKernel, params)
    q, kv_cache, _, _, _, selected = attention_inputs(q, kv_cache, batch, selected)
    result = contiguous_out(out, q.shape, q.dtype, q.device)
    hq, d = shape.num_q_heads, shape.head_dim
    ctas = CTAS_PER_SM * num_sms(q.device.index or 0)
    for rows, run in batch.token_chunks(max(1, PARTIAL_BYTES // (topk * hq * d * 2))):
        run_selected = selected[rows]
        run_handled = handled[rows] if handled is not None else None
        order, item_first, item_count = block_major_items(
            run_selected, run.token_requests, run.block_table.shape[1], tokens_per_item, run_handled
        )
        partial = torch.empty((topk, run.num_tokens, hq, d), dtype=torch.bfloat16, device=q.device)
        lse = torch.full((topk, run.num_tokens, hq), float("-inf"), dtype=torch.float32, device=q.device)
        kernel(
            q[rows], kv_cache, run.block_table, run.seq_lens, run.token_requests, run.positions, run_selected,
            order, item_first, item_count, partial, lse, scale, ctas,
        )  # fmt: skip
        combine_splits(partial, lse, result[rows], run_handled)
    return copy_into(result, out)
