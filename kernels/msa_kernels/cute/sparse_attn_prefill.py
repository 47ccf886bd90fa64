"""CuTeDSL kernel (sm_90a): prefill sparse attention on warpgroup MMAs, K/V pages by TMA.

Computes reference.sparse_attention for prefill and chunked-prefill tokens. A CTA owns G consecutive query
tokens of one request and one index head, in `warpgroups` warpgroups (1 or 2) of 64 MMA rows each: a
warpgroup's G / warpgroups tokens x the m = Hq / Hi query heads of that index head (64 / m tokens a
warpgroup; 4 for MiniMax-M3). The tokens select
their blocks independently, so the CTA reads the union of their selections once, in block order,
and a row ignores the blocks its token did not select (score -inf). Where neighbouring tokens pick
the same blocks (the local block always; in trained models often most of them) one K/V tile feeds
up to G tokens; where they share nothing the CTA reads what G per-token CTAs would, with 4x the
MMA rows, and still in less time than they take (results/README.md, the prefill attention sweep of
2026-12-05), so prefill_sparse_attention gives this kernel every tile, on one warpgroup and one stage.

The kernel still takes a union bound (a tile past it is left, its `handled` flags 0), two warpgroups and more
stages, from the candidates that lost that sweep: prefill_sparse_attention passes no bound a tile can reach, one
warpgroup and one stage. The kernel without them (branch prefill-one-configuration: nearly the same PTX) measured
3-5% slower on an H100 on the trained selections (2026-12-06, two alternating runs, results/README.md), so this
code stays served until the cause is found.

Per union block: TMA loads the page's K and V tiles (128 keys x D) into a ring of `stages` pages
(default 1, so two CTAs share an SM and one computes while the other loads), S = Q K^T (wgmma, both operands in shared
memory), mask (unselected block, causal, keys past the request), online softmax, O += P V (wgmma,
P from registers, V read transposed from shared memory). K and V arrive on barriers of their own: a stage's
K tile is refilled with the next block's as soon as every warp's S is done, so it loads during the softmax and
P V; the V tile once P V is done. V rows past the request's length are
zeroed in shared memory, so stale cache slots (NaN in the tests) never reach the MMA.
"""

from collections.abc import Callable
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel, contiguous_out, copy_into
from msa_kernels.cute.sparse_attn import kv_operand
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
from msa_kernels.plan import Workspace
from msa_kernels.shapes import MSAShape, PagedBatch

MAX_TILE_TOKENS = 16  # a tile's tokens are bits of an int32 set (1 << tokens stays defined)


@dataclass(frozen=True)
class PrefillAttentionParams:
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    num_index_heads: int  # Hi
    head_dim: int  # D
    topk_blocks: int  # K: selection slots per (token, index head)
    block_size: int = 128  # B: tokens per block == per page
    stages: int = 1  # K/V pages per CTA: 1 lets two CTAs share an SM (one computes while the other loads)
    warpgroups: int = 1  # per CTA, each with ROWS rows of its own tokens, all sharing every K/V page the CTA loads

    @property
    def heads_per_index_head(self) -> int:
        return self.num_q_heads // self.num_index_heads

    @property
    def tokens_per_warpgroup(self) -> int:
        return ROWS // self.heads_per_index_head

    @property
    def tokens_per_tile(self) -> int:
        return self.warpgroups * self.tokens_per_warpgroup

    @property
    def threads(self) -> int:
        return self.warpgroups * WARPGROUP

    @property
    def candidates(self) -> int:
        """Selection slots of one tile: the union has at most this many blocks."""
        return self.tokens_per_tile * self.topk_blocks


class PrefillAttentionKernel:
    def __init__(self, params: PrefillAttentionParams):
        assert self.can_implement(
            torch.bfloat16, params.num_q_heads, params.num_index_heads, params.head_dim, params.block_size
        )
        assert params.num_index_heads % params.num_kv_heads == 0
        assert params.tokens_per_tile <= MAX_TILE_TOKENS
        self.p = params

    @classmethod
    def can_implement(
        cls, dtype: torch.dtype, num_q_heads: int, num_index_heads: int, head_dim: int, block_size: int
    ) -> bool:
        """bf16 queries and K/V, 128-token blocks, head dim 64 or 128, m = Hq / Hi query heads per index
        head dividing 64 with at most 16 tokens per tile (m >= 4)."""
        m = num_q_heads // num_index_heads
        return (
            dtype == torch.bfloat16 and block_size == 128 and head_dim in (64, 128) and 4 <= m <= ROWS and ROWS % m == 0
        )

    @staticmethod
    def fake_arguments(params: PrefillAttentionParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        return (
            row_major(bf16, 3, align=16),  # q
            row_major(bf16, 5, align=16),  # kv_cache
            row_major(i32, 2),  # block_table
            row_major(i32, 1),  # seq_lens
            row_major(i32, 1),  # token_position
            row_major(i32, 3),  # selected
            row_major(i32, 2),  # tiles
            row_major(bf16, 3, align=16),  # out
            row_major(i32, 2),  # handled
            cutlass.Int32(0),  # max_union
            cutlass.Float32(1.0),
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [T, Hq, D] bf16
        kv_cache: cute.Tensor,  # [pages, 2, B, Hkv, D] bf16
        block_table: cute.Tensor,  # [R, max_blocks] int32
        seq_lens: cute.Tensor,  # [R] int32
        token_position: cute.Tensor,  # [T] int32
        selected: cute.Tensor,  # [T, Hi, K] int32 logical blocks, ascending, -1 padded
        tiles: cute.Tensor,  # [tiles, 3] int32: request, first token, end token
        out: cute.Tensor,  # [T, Hq, D] bf16
        handled: cute.Tensor,  # [T, Hi] int32 out: 1 where this kernel wrote the rows, 0 where it left them
        max_union: cutlass.Int32,  # tiles whose union has more blocks are left (their handled flags 0)
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        p = self.p
        bf16 = cutlass.BFloat16
        q_layout = cute.tile_to_shape(smem_atom(), (ROWS, p.head_dim, p.warpgroups), (0, 1, 2))
        kv_layout = cute.tile_to_shape(smem_atom(), (p.block_size, p.head_dim, p.stages), (0, 1, 2))
        tma_atom, tma_kv = kv_cache_tma(kv_cache, kv_layout, p.block_size, p.head_dim)
        mma_qk, mma_pv = attention_mmas(p.block_size, p.head_dim)
        row_copy = query_row_copy(p.head_dim)

        @cute.struct
        class Storage:
            full_k: cute.struct.MemRange[cutlass.Int64, p.stages]  # TMA arrival of a stage's K tile
            full_v: cute.struct.MemRange[cutlass.Int64, p.stages]  # and of its V tile
            candidate: cute.struct.MemRange[cutlass.Int32, p.candidates]  # the tokens' selections
            first_seen: cute.struct.MemRange[cutlass.Int32, p.candidates]  # 1: no earlier token has it
            union_block: cute.struct.MemRange[cutlass.Int32, p.candidates]  # distinct blocks, ascending
            union_tokens: cute.struct.MemRange[cutlass.Int32, p.candidates]  # bit g: token g selected it
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]

        self.kernel(
            q,
            tma_kv,
            block_table,
            seq_lens,
            token_position,
            selected,
            tiles,
            out,
            handled,
            max_union,
            scale * LOG2_E,
            tma_atom,
            mma_qk,
            mma_pv,
            row_copy,
            q_layout,
            kv_layout,
            Storage,
        ).launch(
            grid=[cute.size(tiles, mode=[0]), p.num_index_heads, 1],
            block=[p.threads, 1, 1],
            smem=Storage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        tma_kv: cute.Tensor,
        block_table: cute.Tensor,
        seq_lens: cute.Tensor,
        token_position: cute.Tensor,
        selected: cute.Tensor,
        tiles: cute.Tensor,
        out: cute.Tensor,
        handled: cute.Tensor,
        max_union: cutlass.Int32,
        scale_log2: cutlass.Float32,
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
        m, k_max = p.heads_per_index_head, p.topk_blocks
        tidx, _, _ = cute.arch.thread_idx()
        tile, index_head, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        group = warp // 4  # the warpgroup: tokens [group, group + 1) x tokens_per_warpgroup of the tile
        wg_tidx = tidx % WARPGROUP
        group_first_token = group * p.tokens_per_warpgroup
        request = tiles[tile, 0]
        first = tiles[tile, 1]
        num_tokens = tiles[tile, 2] - first
        kv_head = index_head * m // (p.num_q_heads // p.num_kv_heads)
        seq_len = seq_lens[request]
        tx_bytes = p.block_size * p.head_dim * 2  # a K or V tile, bf16

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        full_k = storage.full_k.data_ptr()
        full_v = storage.full_v.data_ptr()
        candidate = storage.candidate.get_tensor(cute.make_layout(p.candidates))
        first_seen = storage.first_seen.get_tensor(cute.make_layout(p.candidates))
        union_block = storage.union_block.get_tensor(cute.make_layout(p.candidates))
        union_tokens = storage.union_tokens.get_tensor(cute.make_layout(p.candidates))
        # wgmma takes affine shared-memory layouts: the swizzle goes into the pointer.
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sVt = transposed_pages(sV, p.block_size, p.head_dim, p.stages)

        if warp == 0:
            cpasync.prefetch_descriptor(tma_atom)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(p.stages):
                    cute.arch.mbarrier_init(full_k + s, 1)
                    cute.arch.mbarrier_init(full_v + s, 1)
            cute.arch.mbarrier_init_fence()

        # The union of the tokens' selections: each distinct block once, ascending, with the bit set
        # of the tokens that selected it.
        for c in range(tidx, p.candidates, p.threads):
            block = cutlass.Int32(-1)
            if c // k_max < num_tokens:
                block = selected[first + c // k_max, index_head, c % k_max]
            candidate[c] = block
        cute.arch.sync_threads()
        for c in range(tidx, p.candidates, p.threads):
            block = candidate[c]
            seen = cutlass.Int32(0)
            if block >= 0:
                seen = 1
                for other in range(c - c % k_max):
                    if candidate[other] == block:
                        seen = 0
            first_seen[c] = seen
        cute.arch.sync_threads()
        union_size = cutlass.Int32(0)
        for c in range(p.candidates):
            union_size += first_seen[c]
        done = cutlass.Int32(1)
        if union_size > max_union:
            done = 0
            union_size = 0
        for g in range(tidx, num_tokens, p.threads):
            handled[first + g, index_head] = done
        for c in range(tidx, p.candidates, p.threads):
            if first_seen[c] != 0:
                block = candidate[c]
                rank = cutlass.Int32(0)
                tokens = cutlass.Int32(0)
                for other in range(p.candidates):
                    if first_seen[other] != 0 and candidate[other] < block:
                        rank += 1
                    if candidate[other] == block:
                        tokens = tokens | (cutlass.Int32(1) << (other // k_max))
                union_block[rank] = block
                union_tokens[rank] = tokens
        cute.arch.sync_threads()

        gKV = cute.local_tile(tma_kv[None, None, kv_head, None, None], (p.block_size, p.head_dim), (0, 0, None, None))
        tKs, tVs, tKVg = page_tiles(tma_atom, gKV, sK, sV)
        if warp == 0:
            for s in cutlass.range_constexpr(p.stages):
                if s < union_size:
                    page = block_table[request, union_block[s]]
                    self.load_tile(tma_atom, tKVg, tKs, full_k, page, 0, s, tx_bytes)
                    self.load_tile(tma_atom, tKVg, tVs, full_v, page, 1, s, tx_bytes)

        # Q rows, each warpgroup its own: row h + m g = token first + group_first_token + g, query head
        # index_head * m + h; rows past the tile's tokens are zero.
        thr_copy = row_copy.get_slice(wg_tidx)
        q_by_head = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[1, 0, 2]))  # (Hq, T, D)
        gQ = cute.group_modes(
            cute.local_tile(
                cute.domain_offset((index_head * m, first + group_first_token, 0), q_by_head),
                (m, p.tokens_per_warpgroup, p.head_dim),
                (0, 0, 0),
            ),
            0,
            2,
        )
        sQ_group = sQ[None, None, group]
        tQg, tQs = thr_copy.partition_S(gQ), thr_copy.partition_D(sQ_group)
        tQc = thr_copy.partition_S(cute.make_identity_tensor((ROWS, p.head_dim)))
        for i in cutlass.range_constexpr(cute.size(tQs, mode=[1])):
            if group_first_token + tQc[0, i, 0][0] // m < num_tokens:
                cute.copy(row_copy, tQg[None, i, None], tQs[None, i, None])
            else:
                tQs[None, i, None].fill(0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, then read by wgmma (async proxy)
        cute.arch.sync_threads()

        thr_qk = mma_qk.get_slice(wg_tidx)
        thr_pv = mma_pv.get_slice(wg_tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ_group))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrVt = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, p.head_dim)), f32)
        acc_o.fill(0.0)
        acc_o_mn = acc_rows_cols(acc_o)
        score_coords = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((ROWS, p.block_size))))
        out_coords = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((ROWS, p.head_dim))))
        rows = cute.size(acc_o_mn, mode=[0])
        row_max = cute.make_rmem_tensor((rows,), f32)
        row_sum = cute.make_rmem_tensor((rows,), f32)
        row_token = cute.make_rmem_tensor((rows,), cutlass.Int32)  # this thread's rows: token in the tile (its bit)
        row_position = cute.make_rmem_tensor((rows,), cutlass.Int32)  # and its position (keys <= it)
        row_max.fill(-f32.inf)
        row_sum.fill(0.0)
        for r in cutlass.range_constexpr(rows):
            row_token[r] = group_first_token + score_coords[r, 0][0] // m
            row_position[r] = -1
            if row_token[r] < num_tokens:
                row_position[r] = token_position[first + row_token[r]]
        all_tokens = (cutlass.Int32(1) << num_tokens) - 1
        earliest = token_position[first]
        tVc = thr_copy.partition_D(cute.make_identity_tensor((p.block_size, p.head_dim)))

        for u in cutlass.range(union_size, unroll=1):
            stage = u % p.stages
            block = union_block[u]
            tokens = union_tokens[u]
            first_key = block * p.block_size
            phase = (u // p.stages) % 2
            cute.arch.mbarrier_wait(full_k + stage, phase)

            # S = Q K^T over the head dim; then the stage's K tile is free for the block `stages` later
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, p.block_size)), f32)
            warpgroup_gemm_nt(mma_qk, acc_s, tSrQ, tSrK, stage)
            cute.arch.sync_threads()  # every warp's S is done
            refill = warp == 0 and u + p.stages < union_size
            next_page = cutlass.Int32(0)
            if refill:
                next_page = block_table[request, union_block[u + p.stages]]
                self.load_tile(tma_atom, tKVg, tKs, full_k, next_page, 0, stage, tx_bytes)

            # Mask (block not selected by the row's token, keys after its position), online softmax.
            acc_s_mn = acc_rows_cols(acc_s)
            masked = cutlass.Int32(0)  # every token selected the block and sees all of it: no mask
            if tokens != all_tokens:
                masked = 1
            if first_key + p.block_size - 1 > earliest:
                masked = 1
            for r in cutlass.range_constexpr(rows):
                if masked != 0:
                    last_key = first_key - 1  # keys the row sees: none unless its token selected the block
                    if (tokens >> row_token[r]) & 1 != 0:
                        last_key = row_position[r]
                    for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                        if first_key + score_coords[r, c][1] > last_key:
                            acc_s_mn[r, c] = -f32.inf
                online_softmax_row(acc_s_mn, acc_o_mn, row_max, row_sum, r, scale_log2)
            tOrP = probabilities(thr_pv, acc_s, ROWS, p.block_size)

            # V rows past the request (its last page) are zeroed, by the first warpgroup.
            cute.arch.mbarrier_wait(full_v + stage, phase)
            valid_keys = seq_len - first_key
            if valid_keys < p.block_size and group == 0:
                zero_rows_past(thr_copy, sV[None, None, stage], tVc, valid_keys)
            cute.arch.sync_threads()

            gemm_pv(mma_pv, acc_o, tOrP, tOrVt[None, None, None, stage])  # O += P V over the page's keys
            cute.arch.sync_threads()  # every warp is done with this stage's V tile: refill it
            if refill:
                self.load_tile(tma_atom, tKVg, tVs, full_v, next_page, 1, stage, tx_bytes)

        # Epilogue: normalise and store the rows of the tile's tokens.
        for r in cutlass.range_constexpr(rows):
            total = quad_reduce(row_sum[r], lambda a, b: a + b)
            inv = 0.0 if total == 0.0 else cute.arch.rcp_approx(total)
            if row_token[r] < num_tokens and done != 0:
                token = first + row_token[r]
                head = index_head * m + out_coords[r, 0][0] % m
                for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    out[token, head, out_coords[r, c][1]] = (acc_o_mn[r, c] * inv).to(cutlass.BFloat16)

    @cute.jit
    def load_tile(self, tma_atom, tKVg, tiles, full, page, kv: cutlass.Constexpr, stage, tx_bytes: cutlass.Constexpr):
        """TMA the K (kv 0) or V (kv 1) tile of `page` into `stage` of `tiles`; arrival on that stage's barrier of
        `full` (warp 0 calls)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, tx_bytes)
        cute.copy(tma_atom, tKVg[None, kv, page], tiles[None, stage], tma_bar_ptr=full + stage)


def prefill_sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.sparse_attention, for bf16 inputs on Hopper: this kernel on each
    request's tiles of consecutive tokens.

    kv_cache: [pages, 2, B, Hkv, D] with D innermost, any other strides 16-byte aligned (vLLM's cache through
    reference.kv_planes); q and out may be strided views. workspace: where the kernel's handled flags go (the
    step part's, reused by its next layer), else a new tensor.
    """
    return bind_attention(batch, shape, selected.shape[-1], workspace)(q, kv_cache, selected, scale, out)


def bind_attention(
    batch: PagedBatch, shape: MSAShape, topk: int, workspace: Workspace | None = None
) -> Callable[..., torch.Tensor]:
    """prefill_sparse_attention bound to a batch and its selections' width (topk) (what a step's layers share
    worked out once): (q, kv_cache, selected, scale, out) -> the output (out where given)."""
    heads = (shape.num_q_heads, shape.num_kv_heads, shape.num_index_heads)
    params = PrefillAttentionParams(*heads, shape.head_dim, topk, shape.block_size)
    kernel = compiled_kernel(PrefillAttentionKernel, params)
    if workspace is None:
        workspace = Workspace(batch.block_table.device)
    handled = workspace.handled_rows((batch.num_tokens, shape.num_index_heads))
    tiles = batch.request_tiles(params.tokens_per_tile)
    batch_inputs = (batch.block_table, batch.seq_lens, batch.positions)

    def attend(
        q: torch.Tensor, kv_cache: torch.Tensor, selected: torch.Tensor, scale: float, out: torch.Tensor | None
    ) -> torch.Tensor:
        result = contiguous_out(out, q.shape, q.dtype, q.device)
        kernel(
            q.contiguous(),
            kv_operand(kv_cache),
            *batch_inputs,
            selected.contiguous(),
            tiles,
            result,
            handled,
            params.candidates,  # no union bound: a tile's union has at most `candidates` blocks
            scale,
        )
        return copy_into(result, out)

    return attend
