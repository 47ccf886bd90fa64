"""CuTeDSL kernel: GQA attention over the selected 128-token blocks of vLLM's paged K/V cache.

Computes reference.sparse_attention for one (query token, index head, head chunk, split) per CTA:
the query heads that share an index head read the same blocks, so they form the rows of one
16-row tile (rows past the group are zero and never stored). One warp runs the tile with tensor
core MMAs (mma.sync m16n8k16, bf16 in, fp32 accumulate): K/V tiles of `tile_keys` keys are
gathered page by page with cp.async into a two-stage shared-memory ring, S = Q K^T, causal mask,
online softmax, O += P V.

Decode has few tokens, so the K/V tiles of a (token, index head)'s selected blocks are split across
CTAs (a split takes a run of tiles, down to one tile of one block: a single sequence spreads its 16
blocks over 128 CTAs at M3's shapes): each split writes its normalised fp32 partial output and
log-sum-exp, and combine.py merges them.
With one split the kernel writes the final bf16 output (large decode batches, prefill tokens over an FP8
K/V cache).

Keys past the request's length are zero-filled in shared memory, so stale cache slots (NaN in the
tests) never reach the MMAs.

An FP8 K/V cache (vLLM's e4m3 bytes with a per-tensor k_scale and v_scale; SparseAttentionParams.fp8_kv)
is gathered by the same cp.async ring into an e4m3 staging ring, which the warp widens into the bf16 tiles
(every e4m3 value is a bf16 value) before the MMAs; k_scale is folded into the softmax scale and v_scale into
the output's normalisation, as reference.sparse_attention's e4m3 x scale.

Launcher: sparse_attention (split-K sized by num_splits; the decode phase's attention, and both phases' over an
FP8 K/V cache).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync, warp

from msa_kernels.cute.combine import bind_combine
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
from msa_kernels.plan import Workspace
from msa_kernels.reference import is_fp8_kv
from msa_kernels.shapes import MSAShape, PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

ROWS = 16  # query heads per tile: the MMA's M
WARP = 32  # threads per CTA: one warp runs a tile
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
    fp8_kv: bool = False  # the K/V cache holds e4m3 values (read as Float8E4M3FN), scaled per tensor

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


class SparseAttentionKernel:
    def __init__(self, params: SparseAttentionParams):
        assert self.can_implement(torch.bfloat16, params.head_dim, params.block_size)
        assert params.num_q_heads % params.num_index_heads == 0 and params.num_index_heads % params.num_kv_heads == 0
        self.p = params

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

        @cute.struct
        class Storage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
            sK8: cute.struct.Align[cute.struct.MemRange[kv_dtype, staging_size], 128]  # fp8_kv: e4m3 staging
            sV8: cute.struct.Align[cute.struct.MemRange[kv_dtype, staging_size], 128]

        cp_async = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        gmem_copy = row_copy(bf16, WARP, p.head_dim, cp_async)
        kv_copy = row_copy(kv_dtype, WARP, p.head_dim, cp_async)
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
            scale * LOG2_E,
            scale,
            v_scale,
            tiles_per_split,
            q_layout,
            kv_layout,
            staging_layout,
            gmem_copy,
            kv_copy,
            mma,
            Storage,
        ).launch(
            grid=[num_tokens, num_splits, p.num_index_heads * p.head_chunks],
            block=[WARP, 1, 1],
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
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        v_scale: cutlass.Float32,
        tiles_per_split: cutlass.Int32,
        q_layout: cute.ComposedLayout,
        kv_layout: cute.ComposedLayout,
        staging_layout: cute.Layout,
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

        # One warp: S = Q K^T and O += P V over each tile, P in registers.
        lane = tidx % 32  # the CTA is one warp
        thr_mma = mma.get_slice(lane)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, p.head_dim)), cutlass.Float32)
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
        score_coords = rows_cols(thr_mma.partition_C(cute.make_identity_tensor((ROWS, p.tile_keys))))

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
            cute.arch.sync_warp()
            if cutlass.const_expr(p.fp8_kv):
                for staged, tile_smem in ((sK_load, sK), (sV_load, sV)):
                    self._widen(kv_thr_copy, staged[None, None, stage], tile_smem[None, None, stage])
                cute.arch.sync_warp()

            # S = Q K^T over the head dim
            tSsK = copy_k.partition_S(sK[None, None, stage])
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, p.tile_keys)), cutlass.Float32)
            acc_s.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsQ, mode=[2])):
                cute.copy(copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
                cute.copy(copy_k, tSsK[None, None, k], tSrK_view[None, None, k])
                cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

            # causal mask (only the query's own block has keys past it), online softmax
            block = selected[token, index_head, (tile0 + tile) // p.tiles_per_block]
            first_key = block * p.block_size + ((tile0 + tile) % p.tiles_per_block) * p.tile_keys
            acc_s_mn = rows_cols(acc_s)
            for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                    if first_key + score_coords[r, c][1] > position:
                        acc_s_mn[r, c] = -cutlass.Float32.inf
            for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                online_softmax_row(acc_s_mn, acc_o_mn, row_max, row_sum, r, scale_log2)

            # O += P V over the tile's keys
            tOsVt = copy_v.partition_S(sVt[None, None, stage])
            r_p = cute.make_fragment_like(acc_s, bf16)
            r_p.store(acc_s.load().to(bf16))
            tOrP = cute.make_tensor(r_p.iterator, as_a_operand(r_p.layout))
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.copy(copy_v, tOsVt[None, None, k], tOrVt_view[None, None, k])
                cute.gemm(mma, acc_o, tOrP[None, None, k], tOrVt[None, None, k], acc_o)
            cute.arch.sync_warp()  # done with this stage: the next tile refills it

        # Epilogue: normalise, store the group's rows and their log-sum-exp.
        for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
            row_sum[r] = quad_reduce(row_sum[r], lambda a, b: a + b)
        out_coords = rows_cols(thr_mma.partition_C(cute.make_identity_tensor((ROWS, p.head_dim))))
        for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
            total = row_sum[r]
            inv = 0.0 if total == 0.0 else cute.arch.rcp_approx(total)
            row = out_coords[r, 0][0]
            if row < rows:
                for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    value = acc_o_mn[r, c] * inv * v_scale
                    column = out_coords[r, c][1]
                    if cutlass.const_expr(p.split):
                        out[split, token, head0 + row, column] = value
                    else:
                        out[split, token, head0 + row, column] = value.to(bf16)
                if tidx % 4 == 0:  # the row's first lane
                    lse = -cutlass.Float32.inf
                    if total > 0.0:
                        lse = row_max[r] * scale + cute.math.log(total, fastmath=True)
                    out_lse[split, token, head0 + row] = lse

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


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM; each resident CTA also takes 1 KB of it
PARTIAL_BYTES = 1 << 30  # largest split-K partial output (fp32) num_splits may ask for: 32 splits of 1024 decode
# tokens at M3's shapes; a long prefill over an FP8 K/V cache (~4 GiB a split at 128K tokens) runs unsplit


def resident_ctas_per_sm(params: SparseAttentionParams) -> int:
    """CTAs of this kernel one SM runs at once: bounded by shared memory (one warp each, few registers)."""

    def aligned(nbytes: int) -> int:
        return -(-nbytes // 1024) * 1024

    q_tile = aligned(ROWS * params.head_dim * 2)
    kv_ring = aligned(2 * params.tile_keys * params.head_dim * 2)  # two stages, bf16
    staging = 2 * aligned(2 * params.tile_keys * params.head_dim) if params.fp8_kv else 0  # two e4m3 stages, K and V
    return max(1, min(32, SMEM_PER_SM // (q_tile + 2 * kv_ring + staging + 1024)))


def num_splits(num_tokens: int, params: SparseAttentionParams, tiles: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, tiles per split) of a selection of `tiles` K/V tiles (slots x tiles_per_block) for
    tokens x heads x splits CTAs that run in waves of resident_ctas.

    Minimises waves x tiles per split (the time of the last wave's CTAs); on a tie the fewer splits
    (less partial output for combine.py); at most the splits whose fp32 partials fit PARTIAL_BYTES. E.g. M3
    decode (32 tiles) at batch 32: 128 CTAs per split, 396 resident on an H200: 3 splits of 11 tiles run in one
    wave, where 4 splits of 8 need two; at batch 1, 32 splits of one tile (128 CTAs).
    """
    ctas = num_tokens * params.num_index_heads * params.head_chunks
    partial_bytes = num_tokens * params.num_q_heads * params.head_dim * 4
    best = None
    for requested in range(1, min(tiles, 64, max(1, PARTIAL_BYTES // partial_bytes)) + 1):
        per_split = -(-tiles // requested)
        splits = -(-tiles // per_split)
        cost = -(-ctas * splits // resident_ctas) * per_split
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def kv_operand(kv_cache: torch.Tensor) -> torch.Tensor:
    """The K/V cache as this kernel and sparse_attn_prefill.py's take it: an FP8 cache's bytes as e4m3."""
    return kv_cache.view(torch.float8_e4m3fn) if is_fp8_kv(kv_cache) else kv_cache


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
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.sparse_attention, for bf16 queries, a bf16 or FP8
    (reference.is_fp8_kv, dequantised with kv_scales = (k_scale, v_scale)) K/V cache and int32 selections on
    Hopper: one token per CTA, split-K merged by combine.py where splits > 1.

    kv_cache: [pages, 2, B, Hkv, D] with D innermost, any other strides 16-byte aligned (vLLM's cache through
    reference.kv_planes); q and out may be strided views. splits: split-K CTAs per (token, head
    tile), chosen by num_splits unless given (benchmarks sweep it; at most slots x tiles_per_block). workspace:
    where the split partials go (the step part's, reused by its next layer), else new tensors.
    """
    attend = bind_attention(batch, shape, selected.shape[-1], is_fp8_kv(kv_cache), workspace, splits)
    return attend(q, kv_cache, selected, scale, out, kv_scales)


def bind_attention(
    batch: PagedBatch,
    shape: MSAShape,
    topk: int,
    fp8_kv: bool,
    workspace: Workspace | None = None,
    splits: int | None = None,
) -> Callable[..., torch.Tensor]:
    """sparse_attention bound to a batch, its selections' width (topk) and K/V cache kind (what a step's layers
    share worked out once): (q, kv_cache, selected, scale, out, kv_scales) -> the output (out where given)."""
    num_tokens, hq, d = batch.num_tokens, shape.num_q_heads, shape.head_dim
    device = batch.block_table.device
    plan = _launch_plan(shape, num_tokens, topk, splits, fp8_kv, device.index or 0)
    batch_inputs = (batch.block_table, batch.seq_lens, batch.token_requests, batch.positions)
    if workspace is None:
        workspace = Workspace(device)
    lse = workspace.split_log_sum_exps((plan.splits, num_tokens, hq))
    partial = workspace.split_outputs((plan.splits, num_tokens, hq, d)) if plan.splits > 1 else None
    combine = bind_combine(partial, lse) if partial is not None else None

    def attend(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        selected: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
        kv_scales: tuple[float, float],
    ) -> torch.Tensor:
        result = contiguous_out(out, q.shape, q.dtype, q.device)
        kernel_out = result.view(1, num_tokens, hq, d) if partial is None else partial
        plan.kernel(
            q.contiguous(),
            kv_operand(kv_cache),
            *batch_inputs,
            selected.contiguous(),
            kernel_out,
            lse,
            scale * kv_scales[0],  # k_scale folds into the softmax scale
            kv_scales[1],
            plan.tiles_per_split,
        )
        if combine is not None:
            combine(result)
        return copy_into(result, out)

    return attend


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
    fp8_kv: bool,
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
        fp8_kv=fp8_kv,
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
