"""CuTeDSL kernel: GQA attention over the selected 128-token blocks of vLLM's paged K/V cache.

Computes reference.sparse_attention for one (query token, index head, head chunk, split) per CTA:
the query heads that share an index head read the same blocks, so they form the rows of one
16-row tile (rows past the group are zero and never stored). One warp runs the tile with tensor
core MMAs (mma.sync m16n8k16, bf16 in, fp32 accumulate): K/V tiles of `tile_keys` keys are
gathered page by page with cp.async into a two-stage shared-memory ring, S = Q K^T, causal mask,
online softmax, O += P V. With SparseAttentionParams.warps > 1 the warps of a CTA share each tile: each
scores a slice of its keys, their row maxima meet in shared memory (every warp then rescales to the same
running max), the probabilities go to shared memory, and each warp accumulates a slice of the output's
columns (P V_slice); the row sums meet once at the end. Serving runs WARPS per CTA.

Decode has few tokens, so the K/V tiles of a (token, index head)'s selected blocks are split across
CTAs (a split takes a run of tiles, down to one tile of one block: a single sequence spreads its 16
blocks over 128 CTAs at M3's shapes): each split writes its normalised fp32 partial output and
log-sum-exp, and combine.py merges them.
With one split the kernel writes the final bf16 output (large decode batches; prefill tokens of
tiles that sparse_attn_prefill.py leaves: the gated variant skips the (token, index head) rows
that kernel marked handled).

Keys past the request's length are zero-filled in shared memory, so stale cache slots (NaN in the
tests) never reach the MMAs.

An FP8 K/V cache (vLLM's e4m3 bytes with a per-tensor k_scale and v_scale; SparseAttentionParams.fp8_kv)
is gathered by the same cp.async ring into an e4m3 staging ring, which the warp widens into the bf16 tiles
(every e4m3 value is a bf16 value) before the MMAs; k_scale is folded into the softmax scale and v_scale into
the output's normalisation, as reference.sparse_attention's e4m3 x scale.

Launchers: sparse_attention (the decode phase's attention, split-K sized by num_splits) and
attend_per_token (the same on converted inputs, also for the tiles sparse_attn_prefill.py leaves).
"""

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync, warp

from msa_kernels.cute.combine import combine_splits
from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.pdl import wait_for_previous_kernel
from msa_kernels.cute.runtime import compiled_kernel, contiguous_out, copy_into, num_sms
from msa_kernels.cute.warp_mma import (
    as_a_operand,
    copy_rows,
    online_softmax_row,
    quad_reduce,
    row_copy,
    rows_cols,
    swizzled_rows,
)
from msa_kernels.reference import is_fp8_kv
from msa_kernels.shapes import MSAShape, PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

ROWS = 16  # query heads per tile: the MMA's M
LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class SparseAttentionParams:
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    num_index_heads: int  # Hi
    head_dim: int  # D
    block_size: int = 128  # B: tokens per block == per page
    tile_keys: int = 64  # keys per K/V shared-memory stage
    split: bool = False  # write fp32 partials + LSE for combine.py instead of the final output
    gated: bool = False  # skip the (token, index head) rows that `handled` marks (the prefill kernel's)
    fp8_kv: bool = False  # the K/V cache holds e4m3 values (read as Float8E4M3FN), scaled per tensor
    warps: int = 1  # per CTA: each scores tile_keys / warps of a tile's keys and accumulates head_dim / warps of
    # P V's columns, the probabilities shared through shared memory (1: one warp runs the tile in registers)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def slice_keys(self) -> int:
        """Keys of a tile one warp scores."""
        return self.tile_keys // self.warps

    @property
    def slice_dim(self) -> int:
        """Output columns one warp accumulates."""
        return self.head_dim // self.warps

    @property
    def heads_per_index_head(self) -> int:
        return self.num_q_heads // self.num_index_heads

    @property
    def head_chunks(self) -> int:
        """16-row tiles per index head."""
        return -(-self.heads_per_index_head // ROWS)

    @property
    def tiles_per_block(self) -> int:
        return self.block_size // self.tile_keys


def warps_can_share_tile(warps: int, head_dim: int, tile_keys: int = 64) -> bool:
    """Whether `warps` warps can share a tile: whole 16-wide MMA tiles of keys and of output columns each, and
    (several warps) 64-column head dims, which their copies of the 16-row Q tile cover in whole rows."""
    return tile_keys % (16 * warps) == 0 and head_dim % (16 * warps) == 0 and (warps == 1 or head_dim % 64 == 0)


class SparseAttentionKernel:
    def __init__(self, params: SparseAttentionParams):
        assert self.can_implement(torch.bfloat16, params.head_dim, params.block_size)
        assert params.num_q_heads % params.num_index_heads == 0 and params.num_index_heads % params.num_kv_heads == 0
        assert warps_can_share_tile(params.warps, params.head_dim, params.tile_keys)
        self.p = params
        self.threads = params.threads

    @classmethod
    def can_implement(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """bf16 queries and K/V, 128-token blocks, head dim a multiple of 32 up to 256."""
        return dtype == torch.bfloat16 and block_size == 128 and head_dim % 32 == 0 and head_dim <= 256

    @staticmethod
    def fake_arguments(params: SparseAttentionParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
        return (
            row_major(bf16, 3, align=16),  # q
            row_major(cutlass.Float8E4M3FN if params.fp8_kv else bf16, 5, align=16),  # kv_cache
            row_major(i32, 2),  # block_table
            row_major(i32, 1),  # seq_lens
            row_major(i32, 1),  # token_request
            row_major(i32, 1),  # token_position
            row_major(i32, 3),  # selected
            row_major(f32 if params.split else bf16, 4, align=16),  # out
            row_major(f32, 3),  # out_lse
            row_major(i32, 2) if params.gated else None,  # handled
            cutlass.Float32(1.0),  # scale (x k_scale for FP8 K/V)
            cutlass.Float32(1.0),  # v_scale
            cutlass.Int32(1),
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [T, Hq, D] bf16
        kv_cache: cute.Tensor,  # [pages, 2, B, Hkv, D] bf16, or e4m3 (fp8_kv)
        block_table: cute.Tensor,  # [R, max_blocks] int32
        seq_lens: cute.Tensor,  # [R] int32
        token_request: cute.Tensor,  # [T] int32
        token_position: cute.Tensor,  # [T] int32
        selected: cute.Tensor,  # [T, Hi, K] int32 logical blocks, ascending, -1 padded
        out: cute.Tensor,  # [S, T, Hq, D]: bf16 final output (S == 1), or fp32 partials (split)
        out_lse: cute.Tensor,  # [S, T, Hq] fp32
        handled: cute.Tensor | None,  # [T, Hi] int32, gated only: nonzero rows are already written
        scale: cutlass.Float32,  # the softmax scale, times k_scale for FP8 K/V
        v_scale: cutlass.Float32,  # 1, or the FP8 cache's v_scale
        tiles_per_split: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        p = self.p
        bf16 = cutlass.BFloat16
        q_layout = swizzled_rows(p.head_dim, ROWS)
        kv_layout = swizzled_rows(p.head_dim, p.tile_keys, 2)
        kv_dtype = kv_cache.element_type
        staging_layout = cute.make_layout(
            (p.tile_keys, p.head_dim, 2), stride=(p.head_dim, 1, p.tile_keys * p.head_dim)
        )  # row-major e4m3 stages
        staging_size = cute.cosize(staging_layout) if p.fp8_kv else 1
        p_layout = swizzled_rows(p.tile_keys, ROWS)  # warps > 1: the tile's probabilities, the A of P V
        warps_share_tile = p.warps > 1
        p_align = 1024 if warps_share_tile else 4

        @cute.struct
        class Storage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sK8: cute.struct.Align[cute.struct.MemRange[kv_dtype, staging_size], 128]  # fp8_kv: e4m3 staging
            sV8: cute.struct.Align[cute.struct.MemRange[kv_dtype, staging_size], 128]
            sP: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(p_layout) if warps_share_tile else 1], p_align]
            sRowStat: cute.struct.MemRange[
                cutlass.Float32, p.warps * ROWS if warps_share_tile else 1
            ]  # row max, then sum

        cp_async = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        gmem_copy = row_copy(bf16, self.threads, p.head_dim, cp_async)
        kv_copy = row_copy(kv_dtype, self.threads, p.head_dim, cp_async)
        mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(bf16, cutlass.Float32, (16, 8, 16)), (1, 1, 1), permutation_mnk=(ROWS, 16, 16)
        )
        num_splits = cute.size(out, mode=[0])
        num_tokens = cute.size(q, mode=[0])
        self.kernel(
            q,
            kv_cache,
            block_table,
            seq_lens,
            token_request,
            token_position,
            selected,
            out,
            out_lse,
            handled,
            scale * LOG2_E,
            scale,
            v_scale,
            tiles_per_split,
            q_layout,
            kv_layout,
            staging_layout,
            p_layout,
            gmem_copy,
            kv_copy,
            mma,
            Storage,
        ).launch(
            grid=[num_tokens, num_splits, p.num_index_heads * p.head_chunks],
            block=[self.threads, 1, 1],
            smem=Storage.size_in_bytes(),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        kv_cache: cute.Tensor,
        block_table: cute.Tensor,
        seq_lens: cute.Tensor,
        token_request: cute.Tensor,
        token_position: cute.Tensor,
        selected: cute.Tensor,
        out: cute.Tensor,
        out_lse: cute.Tensor,
        handled: cute.Tensor | None,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        v_scale: cutlass.Float32,
        tiles_per_split: cutlass.Int32,
        q_layout: cute.ComposedLayout,
        kv_layout: cute.ComposedLayout,
        staging_layout: cute.Layout,
        p_layout: cute.ComposedLayout,
        gmem_copy: cute.TiledCopy,
        kv_copy: cute.TiledCopy,
        mma: cute.TiledMma,
        Storage: cutlass.Constexpr,
    ):
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        p = self.p
        bf16 = cutlass.BFloat16
        m = p.heads_per_index_head
        tidx, _, _ = cute.arch.thread_idx()
        token, split, head_tile = cute.arch.block_idx()
        index_head = head_tile // p.head_chunks
        head0 = index_head * m + (head_tile % p.head_chunks) * ROWS
        rows = cutlass.min(ROWS, (index_head + 1) * m - head0)
        kv_head = index_head * m // (p.num_q_heads // p.num_kv_heads)
        request = token_request[token]
        position = token_position[token]
        seq_len = seq_lens[request]

        # The split's tiles [tile0, tile1) of the selection's slots x tiles_per_block; those of slots
        # that hold a block come first (the selection is ascending, -1 padded), and the last visible
        # block (the query's own, the highest) is cut at the query position.
        tile0 = split * tiles_per_split
        tile1 = cutlass.min(tile0 + tiles_per_split, cute.size(selected, mode=[2]) * p.tiles_per_block)
        first_slot = tile0 // p.tiles_per_block
        num_valid = cutlass.Int32(0)
        for s in range(first_slot, (tile1 + p.tiles_per_block - 1) // p.tiles_per_block):
            if selected[token, index_head, s] >= 0:
                num_valid += 1
        valid_end = (first_slot + num_valid) * p.tiles_per_block
        last_block = selected[token, index_head, cutlass.max(first_slot + num_valid - 1, 0)]
        if num_valid > 0 and last_block == position // p.block_size:
            valid_end -= p.tiles_per_block - (position % p.block_size) // p.tile_keys - 1
        num_tiles = cutlass.max(cutlass.min(tile1, valid_end) - tile0, 0)
        skipped = cutlass.Int32(0)
        if cutlass.const_expr(p.gated):
            skipped = handled[token, index_head]
        if skipped != 0:
            num_tiles = 0

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        sQ = storage.sQ.get_tensor(q_layout)
        sK = storage.sK.get_tensor(kv_layout)
        sV = storage.sV.get_tensor(kv_layout)
        sVt = cute.composition(
            sV, cute.make_layout((p.head_dim, p.tile_keys, 2), stride=(p.tile_keys, 1, p.tile_keys * p.head_dim))
        )

        # K/V tiles land in sK / sV, or (fp8_kv) in the e4m3 staging ring sK8 / sV8 that convert_tile widens.
        sK_load, sV_load = sK, sV
        if cutlass.const_expr(p.fp8_kv):
            sK_load = storage.sK8.get_tensor(staging_layout)
            sV_load = storage.sV8.get_tensor(staging_layout)
        thr_copy = gmem_copy.get_slice(tidx)
        kv_thr_copy = kv_copy.get_slice(tidx)
        tile_coords = kv_thr_copy.partition_S(cute.make_identity_tensor((p.tile_keys, p.head_dim)))

        # Q rows of this tile; rows past the group are zero.
        gQ = cute.local_tile(cute.domain_offset((head0, 0), q[token, None, None]), (ROWS, p.head_dim), (0, 0))
        copy_rows(gmem_copy, thr_copy, gQ, sQ, rows, (ROWS, p.head_dim))

        # Each warp scores its slice of a tile's keys (S = Q K_slice^T) and accumulates its slice of the
        # output's columns (O_slice += P V_slice); one warp: the whole tile, P in registers.
        warp_idx = 0  # the CTA's warp: one, or each with a slice of the tile
        if cutlass.const_expr(p.warps > 1):
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        thr_mma = mma.get_slice(lane)
        key_slice = lambda t: cute.local_tile(t, (p.slice_keys, p.head_dim), (warp_idx, 0))  # noqa: E731
        dim_slice = lambda t: cute.local_tile(t, (p.slice_dim, p.tile_keys), (warp_idx, 0))  # noqa: E731
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(key_slice(sK[None, None, 0])))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(dim_slice(sVt[None, None, 0])))
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, p.slice_dim)), cutlass.Float32)
        acc_o.fill(0.0)
        ldmatrix = lambda transpose: cute.make_copy_atom(  # noqa: E731
            warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), bf16
        )
        copy_q = cute.make_tiled_copy_A(ldmatrix(False), mma).get_slice(lane)
        copy_k = cute.make_tiled_copy_B(ldmatrix(False), mma).get_slice(lane)
        copy_v = cute.make_tiled_copy_B(ldmatrix(True), mma).get_slice(lane)
        tSsQ = copy_q.partition_S(sQ)
        tSrQ_view = copy_q.retile(tSrQ)
        tSrK_view = copy_k.retile(tSrK)
        tOrVt_view = copy_v.retile(tOrVt)
        score_coords = rows_cols(thr_mma.partition_C(cute.make_identity_tensor((ROWS, p.slice_keys))))
        if cutlass.const_expr(p.warps > 1):  # what the warps exchange: each warp's row statistics, the probabilities
            row_stat = storage.sRowStat.get_tensor(cute.make_layout((p.warps, ROWS), stride=(ROWS, 1)))
            sP = storage.sP.get_tensor(p_layout)
            tOrP_shared = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
            tOsP = copy_q.partition_S(sP)
            tOrP_shared_view = copy_q.retile(tOrP_shared)

        acc_o_mn = rows_cols(acc_o)
        row_max = cute.make_rmem_tensor((cute.size(acc_o_mn, mode=[0]),), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((cute.size(acc_o_mn, mode=[0]),), cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)

        tile_source = SimpleNamespace(
            kv_cache=kv_cache,
            block_table=block_table,
            selected=selected,
            request=request,
            token=token,
            index_head=index_head,
            kv_head=kv_head,
            tile0=tile0,
            seq_len=seq_len,
        )
        if num_tiles > 0:
            self._load_tile(tile_source, 0, 0, sK_load, sV_load, kv_thr_copy, kv_copy, tile_coords)
        cute.arch.cp_async_commit_group()
        for tile in range(num_tiles):
            stage = tile % 2
            if tile + 1 < num_tiles:
                self._load_tile(tile_source, tile + 1, 1 - stage, sK_load, sV_load, kv_thr_copy, kv_copy, tile_coords)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            self._sync()
            if cutlass.const_expr(p.fp8_kv):
                for staged, tile_smem in ((sK_load, sK), (sV_load, sV)):
                    self._widen(kv_thr_copy, staged[None, None, stage], tile_smem[None, None, stage])
                self._sync()

            # S = Q K^T over the head dim, for this warp's keys
            tSsK = copy_k.partition_S(key_slice(sK[None, None, stage]))
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, p.slice_keys)), cutlass.Float32)
            acc_s.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsQ, mode=[2])):
                cute.copy(copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
                cute.copy(copy_k, tSsK[None, None, k], tSrK_view[None, None, k])
                cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

            # causal mask (only the query's own block has keys past it), online softmax
            block = selected[token, index_head, (tile0 + tile) // p.tiles_per_block]
            first_key = block * p.block_size + ((tile0 + tile) % p.tiles_per_block) * p.tile_keys
            first_key += warp_idx * p.slice_keys
            acc_s_mn = rows_cols(acc_s)
            for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                    if first_key + score_coords[r, c][1] > position:
                        acc_s_mn[r, c] = -cutlass.Float32.inf
            if cutlass.const_expr(p.warps == 1):
                for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                    online_softmax_row(acc_s_mn, acc_o_mn, row_max, row_sum, r, scale_log2)
            else:
                slice_max = cute.make_rmem_tensor(row_max.shape, cutlass.Float32)
                for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                    values = acc_s_mn[r, None].load()
                    slice_max[r] = quad_reduce(
                        values.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0), cute.arch.fmax
                    )
                tile_max = self._across_warps(slice_max, score_coords, row_stat, lane, warp_idx, cute.arch.fmax)
                for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                    online_softmax_row(acc_s_mn, acc_o_mn, row_max, row_sum, r, scale_log2, tile_max[r])
                    for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                        row, key = score_coords[r, c]
                        sP[row, warp_idx * p.slice_keys + key] = acc_s_mn[r, c].to(bf16)
                self._sync()

            # O += P V over the tile's keys, for this warp's columns
            tOsVt = copy_v.partition_S(dim_slice(sVt[None, None, stage]))
            if cutlass.const_expr(p.warps == 1):
                r_p = cute.make_fragment_like(acc_s, bf16)
                r_p.store(acc_s.load().to(bf16))
                tOrP = cute.make_tensor(r_p.iterator, as_a_operand(r_p.layout))
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.copy(copy_v, tOsVt[None, None, k], tOrVt_view[None, None, k])
                    cute.gemm(mma, acc_o, tOrP[None, None, k], tOrVt[None, None, k], acc_o)
            else:
                for k in cutlass.range_constexpr(cute.size(tOsP, mode=[2])):
                    cute.copy(copy_q, tOsP[None, None, k], tOrP_shared_view[None, None, k])
                    cute.copy(copy_v, tOsVt[None, None, k], tOrVt_view[None, None, k])
                    cute.gemm(mma, acc_o, tOrP_shared[None, None, k], tOrVt[None, None, k], acc_o)
            self._sync()  # every warp is done with this stage (and sP): the next tile refills them

        # Epilogue: normalise, store this warp's columns of the group's rows, and their log-sum-exp.
        for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
            row_sum[r] = quad_reduce(row_sum[r], lambda a, b: a + b)
        if cutlass.const_expr(p.warps > 1):  # each warp summed its keys' probabilities against the same max
            row_sum = self._across_warps(row_sum, score_coords, row_stat, lane, warp_idx, lambda a, b: a + b)
        out_coords = rows_cols(thr_mma.partition_C(cute.make_identity_tensor((ROWS, p.slice_dim))))
        for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
            total = row_sum[r]
            inv = 0.0 if total == 0.0 else cute.arch.rcp_approx(total)
            row = out_coords[r, 0][0]
            if row < rows and skipped == 0:
                for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    value = acc_o_mn[r, c] * inv * v_scale
                    column = warp_idx * p.slice_dim + out_coords[r, c][1]
                    if cutlass.const_expr(p.split):
                        out[split, token, head0 + row, column] = value
                    else:
                        out[split, token, head0 + row, column] = value.to(bf16)
                if tidx % 4 == 0 and tidx < 32:  # warp 0, the row's first lane
                    lse = -cutlass.Float32.inf
                    if total > 0.0:
                        lse = row_max[r] * scale + cute.math.log(total, fastmath=True)
                    out_lse[split, token, head0 + row] = lse

    @cute.jit
    def _sync(self):
        """Wait for every thread of the CTA (a warp, or all warps where they share the tile)."""
        if cutlass.const_expr(self.p.warps == 1):
            cute.arch.sync_warp()
        else:
            cute.arch.barrier()

    @cute.jit
    def _across_warps(self, per_row: cute.Tensor, coords: cute.Tensor, row_stat: cute.Tensor, lane, warp_idx, op):
        """per_row: a value for each of this thread's accumulator rows (coords: the (rows, cols) coordinates),
        the same over the row's quad; returns them reduced with `op` over all warps, the same in every warp.
        Synchronises the CTA before and after reading row_stat, so the caller may reuse it right after."""
        num_rows = cute.size(per_row)
        for r in cutlass.range_constexpr(num_rows):
            if lane % 4 == 0:
                row_stat[warp_idx, coords[r, 0][0]] = per_row[r]
        self._sync()
        result = cute.make_rmem_tensor((num_rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(num_rows):
            result[r] = row_stat[0, coords[r, 0][0]]
            for w in cutlass.range_constexpr(1, self.p.warps):
                result[r] = op(result[r], row_stat[w, coords[r, 0][0]])
        self._sync()
        return result

    @cute.jit
    def _widen(self, kv_thr_copy, staged: cute.Tensor, tile_smem: cute.Tensor):
        """e4m3 -> bf16 (exact) of the chunks of one stage this thread loaded, into the MMAs' tile."""
        src = kv_thr_copy.partition_D(staged)
        dst = kv_thr_copy.partition_D(tile_smem)
        for i in cutlass.range_constexpr(cute.size(src, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(src, mode=[2])):
                chunk = cute.make_fragment_like(src[None, i, j])
                cute.autovec_copy(src[None, i, j], chunk)
                dst[None, i, j].store(chunk.load().to(cutlass.Float32).to(cutlass.BFloat16))

    @cute.jit
    def _load_tile(self, source: SimpleNamespace, tile, stage, sK, sV, thr_copy, gmem_copy, tile_coords):
        """cp.async keys and values of tile `tile` of the split into stage `stage`; rows past the
        request's length are zero-filled."""
        p = self.p
        block = source.selected[source.token, source.index_head, (source.tile0 + tile) // p.tiles_per_block]
        sub = (source.tile0 + tile) % p.tiles_per_block
        page = source.block_table[source.request, block]
        first_key = block * p.block_size + sub * p.tile_keys
        for kv, smem in ((0, sK), (1, sV)):
            g = cute.local_tile(
                source.kv_cache[page, kv, None, source.kv_head, None], (p.tile_keys, p.head_dim), (sub, 0)
            )
            src = thr_copy.partition_S(g)
            dst = thr_copy.partition_D(smem[None, None, stage])
            for i in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                if first_key + tile_coords[0, i, 0][0] < source.seq_len:
                    cute.copy(gmem_copy, src[None, i, None], dst[None, i, None])
                else:
                    dst[None, i, None].fill(0)


WARPS = 1  # per CTA in serving; 4 (warps_can_share_tile) is the candidate the decode split sweep measures against it
SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM; each resident CTA also takes 1 KB of it


def resident_ctas_per_sm(params: SparseAttentionParams) -> int:
    """CTAs of this kernel one SM runs at once: bounded by shared memory (a few warps each, few registers)."""

    def aligned(nbytes: int) -> int:
        return -(-nbytes // 1024) * 1024

    q_tile = aligned(ROWS * params.head_dim * 2)
    kv_ring = aligned(2 * params.tile_keys * params.head_dim * 2)  # two stages, bf16
    staging = 2 * aligned(2 * params.tile_keys * params.head_dim) if params.fp8_kv else 0  # two e4m3 stages, K and V
    p_tile = aligned(ROWS * params.tile_keys * 2) if params.warps > 1 else 0
    row_stats = aligned(params.warps * ROWS * 4) if params.warps > 1 else 0
    return max(
        1, min(32, 64 // params.warps, SMEM_PER_SM // (q_tile + 2 * kv_ring + staging + p_tile + row_stats + 1024))
    )


def num_splits(num_tokens: int, params: SparseAttentionParams, tiles: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, tiles per split) of a selection of `tiles` K/V tiles (slots x tiles_per_block) for
    tokens x heads x splits CTAs that run in waves of resident_ctas.

    Minimises waves x tiles per split (the time of the last wave's CTAs); on a tie the fewer splits
    (less partial output for combine.py). E.g. M3 decode (32 tiles) at batch 32: 128 CTAs per split,
    396 resident on an H200: 3 splits of 11 tiles run in one wave, where 4 splits of 8 need two; at
    batch 1, 32 splits of one tile (128 CTAs).
    """
    ctas = num_tokens * params.num_index_heads * params.head_chunks
    best = None
    for requested in range(1, min(tiles, 64) + 1):
        per_split = -(-tiles // requested)
        splits = -(-tiles // per_split)
        cost = -(-ctas * splits // resident_ctas) * per_split
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, selected: torch.Tensor) -> tuple:
    """(q, kv_cache, block_table, seq_lens, positions, selected) as both attention kernels take them (q and
    selected contiguous; the batch's index tensors are int32, selected must be; an FP8 K/V cache's bytes as
    e4m3), made once: the prefill kernel and the per-token kernel for the tiles it leaves share them."""
    if is_fp8_kv(kv_cache):
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    return (q.contiguous(), kv_cache, batch.block_table, batch.seq_lens, batch.positions, selected.contiguous())


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    selected: torch.Tensor,
    shape: MSAShape,
    scale: float,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    warps: int = WARPS,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.sparse_attention, for bf16 queries, a bf16 or FP8
    (reference.is_fp8_kv, dequantised with kv_scales) K/V cache and int32 selections on Hopper: one token per
    CTA.

    kv_cache must be contiguous; q and out may be strided views. splits: split-K CTAs per (token, head
    tile), chosen by num_splits unless given (benchmarks sweep it; at most slots x tiles_per_block). warps:
    per CTA, sharing each tile (SparseAttentionParams.warps; warps_can_share_tile must accept it).
    """
    result = contiguous_out(out, q.shape, q.dtype, q.device)
    inputs = attention_inputs(q, kv_cache, batch, selected)
    attend_per_token(inputs, batch, shape, selected.shape[-1], result, scale, splits, kv_scales=kv_scales, warps=warps)
    return copy_into(result, out)


def attend_per_token(
    inputs: tuple,
    batch: PagedBatch,
    shape: MSAShape,
    topk: int,
    result: torch.Tensor,
    scale: float,
    splits: int | None = None,
    handled: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    warps: int = WARPS,
) -> None:
    """The per-token kernel on attention_inputs into the contiguous result [T, Hq, D]: split-K merged by
    combine.py where splits > 1; with `handled` ([T, Hi] int32, the prefill kernel's flags) the gated
    variant, which skips the rows already written. kv_scales: an FP8 cache's (k_scale, v_scale); warps: per CTA."""
    num_tokens, hq, d = batch.num_tokens, shape.num_q_heads, shape.head_dim
    q, kv_cache, block_table, seq_lens, positions, selected = inputs
    fp8_kv = kv_cache.dtype == torch.float8_e4m3fn
    plan = _launch_plan(shape, num_tokens, topk, splits, handled is not None, fp8_kv, warps, result.device.index or 0)
    token_inputs = (q, kv_cache, block_table, seq_lens, batch.token_requests, positions, selected)
    scales = (scale * kv_scales[0], kv_scales[1])  # k_scale folds into the softmax scale
    lse = batch.scratch("split log-sum-exps", (plan.splits, num_tokens, hq), torch.float32)
    if plan.splits == 1:
        plan.kernel(*token_inputs, result.view(1, num_tokens, hq, d), lse, handled, *scales, plan.tiles_per_split)
    else:
        partial = batch.scratch("split outputs", (plan.splits, num_tokens, hq, d), torch.float32)
        plan.kernel(*token_inputs, partial, lse, None, *scales, plan.tiles_per_split)
        combine_splits(partial, lse, result)


class LaunchPlan(NamedTuple):
    kernel: "tvm_ffi.Function"
    splits: int
    tiles_per_split: int


@functools.lru_cache(maxsize=4096)
def _launch_plan(
    shape: MSAShape,
    num_tokens: int,
    topk: int,
    splits: int | None,
    gated: bool,
    fp8_kv: bool,
    warps: int,
    device_index: int,
) -> LaunchPlan:
    """The compiled kernel and split-K of a call (splits: the caller's, else num_splits'), worked out once
    per call shape: an eager layer call pays a cache lookup, not the search."""
    params = SparseAttentionParams(
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.num_index_heads,
        shape.head_dim,
        shape.block_size,
        gated=gated,
        fp8_kv=fp8_kv,
        warps=warps,
    )
    tiles = topk * params.tiles_per_block
    if splits is None:
        resident = resident_ctas_per_sm(params) * num_sms(device_index)
        splits, per_split = num_splits(num_tokens, params, tiles, resident)
    else:
        per_split = -(-tiles // splits)
        splits = -(-tiles // per_split)
    if splits > 1:
        params = replace(params, split=True)
    return LaunchPlan(compiled_kernel(SparseAttentionKernel, params), splits, per_split)
