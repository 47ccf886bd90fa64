"""CuTeDSL kernel: proxy block scores for prefill chunks on tensor cores (mma.sync m16n8k16).

Computes reference.proxy_block_scores for the query tokens of a tile of one request: out[t, h, b]
= max over visible keys j of block b of index_q[t, h] . proxy_key[j, h // (Hi / Hki)]. One CTA
(4 warps, 64 query tokens, 16 a warp) per (tile, index head) walks the request's blocks up to the
tile's last visible one: the block's 128 proxy keys come in through a two-stage cp.async ring,
S = Q K^T on the tensor cores, keys past each row's position are masked, and each row's max is
reduced over its quad and stored. This is the quadratic part of an MSA prefill; the decode path
(few tokens a request) is proxy_scores.py.

Blocks past a tile's last visible block are not written: the caller fills out with -inf.
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_stream

from kernels.cute import PREFILL_TILE_TOKENS, prefill_proxy_scores_supported
from kernels.cute.fake import row_major
from kernels.cute.warp_mma import copy_rows, quad_reduce, row_copy, rows_cols, swizzled_rows

WARPS = 4


@dataclass(frozen=True)
class PrefillProxyScoreParams:
    num_index_heads: int  # Hi
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    block_size: int = 128  # B: keys a stage


class PrefillProxyScoreKernel:
    threads = 32 * WARPS

    def __init__(self, params: PrefillProxyScoreParams):
        assert params.num_index_heads % params.num_index_key_heads == 0
        assert prefill_proxy_scores_supported(params.index_head_dim, params.block_size)
        self.p = params

    @cute.jit
    def __call__(
        self,
        index_q: cute.Tensor,  # [T, Hi, Dp] bf16
        proxy_cache: cute.Tensor,  # [pages, B, Hki, Dp] bf16
        block_table: cute.Tensor,  # [R, max_blocks] int32
        token_position: cute.Tensor,  # [T] int32
        tiles: cute.Tensor,  # [tiles, 3] int32: request, first token, end token
        out: cute.Tensor,  # [T, Hi, max_blocks] fp32, pre-filled with -inf
        stream: cuda.CUstream,
    ):
        p = self.p
        bf16 = cutlass.BFloat16
        q_layout = swizzled_rows(p.index_head_dim, PREFILL_TILE_TOKENS)
        k_layout = swizzled_rows(p.index_head_dim, p.block_size, 2)

        @cute.struct
        class Storage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(k_layout)], 1024]

        gmem_copy = row_copy(bf16, self.threads, p.index_head_dim, cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL))
        mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(bf16, cutlass.Float32, (16, 8, 16)), (WARPS, 1, 1), permutation_mnk=(PREFILL_TILE_TOKENS, 16, 16)
        )
        self.kernel(
            index_q, proxy_cache, block_table, token_position, tiles, out, q_layout, k_layout, gmem_copy, mma, Storage
        ).launch(
            grid=[cute.size(tiles, mode=[0]), p.num_index_heads, 1],
            block=[self.threads, 1, 1],
            smem=Storage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        index_q: cute.Tensor,
        proxy_cache: cute.Tensor,
        block_table: cute.Tensor,
        token_position: cute.Tensor,
        tiles: cute.Tensor,
        out: cute.Tensor,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        gmem_copy: cute.TiledCopy,
        mma: cute.TiledMma,
        Storage: cutlass.Constexpr,
    ):
        p = self.p
        bf16 = cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, _ = cute.arch.block_idx()
        key_head = head // (p.num_index_heads // p.num_index_key_heads)
        request = tiles[tile, 0]
        first_token = tiles[tile, 1]
        num_rows = tiles[tile, 2] - first_token
        num_blocks = token_position[first_token + num_rows - 1] // p.block_size + 1

        storage = cutlass.utils.SmemAllocator().allocate(Storage)
        sQ = storage.sQ.get_tensor(q_layout)
        sK = storage.sK.get_tensor(k_layout)
        thr_copy = gmem_copy.get_slice(tidx)

        # The tile's index queries; rows past the request's tokens are zero and never stored.
        tile_shape = (PREFILL_TILE_TOKENS, p.index_head_dim)
        gQ = cute.local_tile(cute.domain_offset((first_token, 0), index_q[None, head, None]), tile_shape, (0, 0))
        copy_rows(gmem_copy, thr_copy, gQ, sQ, num_rows, tile_shape)

        thr_mma = mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        ldmatrix = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16)
        copy_q = cute.make_tiled_copy_A(ldmatrix, mma).get_slice(tidx)
        copy_k = cute.make_tiled_copy_B(ldmatrix, mma).get_slice(tidx)
        tSsQ = copy_q.partition_S(sQ)
        tSrQ_view = copy_q.retile(tSrQ)
        tSrK_view = copy_k.retile(tSrK)
        score_coords = rows_cols(thr_mma.partition_C(cute.make_identity_tensor((PREFILL_TILE_TOKENS, p.block_size))))

        # Position of each accumulator row this thread holds (-1 past the request's tokens).
        acc_shape = thr_mma.partition_shape_C((PREFILL_TILE_TOKENS, p.block_size))
        num_my_rows = cute.size(score_coords, mode=[0])
        row_position = cute.make_rmem_tensor((num_my_rows,), cutlass.Int32)
        for r in cutlass.range_constexpr(num_my_rows):
            row = score_coords[r, 0][0]
            row_position[r] = -1
            if row < num_rows:
                row_position[r] = token_position[first_token + row]

        self._load_block(proxy_cache, block_table, request, key_head, 0, 0, sK, thr_copy, gmem_copy)
        cute.arch.cp_async_commit_group()
        for block in range(num_blocks):
            stage = block % 2
            if block + 1 < num_blocks:
                self._load_block(proxy_cache, block_table, request, key_head, block + 1, 1 - stage, sK, thr_copy,
                                 gmem_copy)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()

            tSsK = copy_k.partition_S(sK[None, None, stage])
            acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            acc.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsQ, mode=[2])):
                cute.copy(copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
                cute.copy(copy_k, tSsK[None, None, k], tSrK_view[None, None, k])
                cute.gemm(mma, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)

            acc_mn = rows_cols(acc)
            first_key = block * p.block_size
            for r in cutlass.range_constexpr(num_my_rows):
                best = -cutlass.Float32.inf
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    if first_key + score_coords[r, c][1] <= row_position[r]:
                        best = cute.arch.fmax(best, acc_mn[r, c])
                best = quad_reduce(best, cute.arch.fmax)
                if tidx % 4 == 0 and first_key <= row_position[r]:
                    out[first_token + score_coords[r, 0][0], head, block] = best
            cute.arch.sync_threads()

    @cute.jit
    def _load_block(self, proxy_cache, block_table, request, key_head, block, stage, sK, thr_copy, gmem_copy):
        """cp.async the block's proxy keys into stage `stage` (slots past the request's length hold
        stale keys; their scores are masked)."""
        p = self.p
        page = block_table[request, block]
        keys = cute.local_tile(proxy_cache[page, None, key_head, None], (p.block_size, p.index_head_dim), (0, 0))
        src = thr_copy.partition_S(keys)
        dst = thr_copy.partition_D(sK[None, None, stage])
        cute.copy(gmem_copy, src, dst)


def fake_arguments(params: PrefillProxyScoreParams):
    """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
    bf16, i32 = cutlass.BFloat16, cutlass.Int32
    return (
        row_major(bf16, 3, align=16),  # index_q
        row_major(bf16, 4, align=16),  # proxy_cache
        row_major(i32, 2),  # block_table
        row_major(i32, 1),  # token_position
        row_major(i32, 2),  # tiles
        row_major(cutlass.Float32, 3),  # out
        make_fake_stream(),
    )


def compile_kernel(params: PrefillProxyScoreParams):
    return cute.compile(PrefillProxyScoreKernel(params), *fake_arguments(params))
