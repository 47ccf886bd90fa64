"""CuTeDSL kernel (sm_90a): index block scores for prefill chunks on warpgroup MMAs, index keys by TMA.

Computes reference.index_block_scores for the query tokens of a tile of one request: out[t, h, b]
= max over visible keys j of block b of index_q[t, h] . index_key[j, h // (Hi / Hki)]. This is the
quadratic part of an MSA prefill; the decode path (few tokens a request) is index_scores.py.

Two variants (PrefillIndexScoreParams.fp8): bf16 index queries and keys on bf16 MMAs, or an FP8 index-key
cache (msa_kernels.fp8_index_keys: e4m3 values, a float32 scale per key) on e4m3 MMAs (m64n128k32, twice
bf16's rate, half its bytes), the index queries rounded to e4m3 per (token, index head) by the launcher as
the reference rounds them. The FP8 scores are q8 . k8 x key scale x query scale: each column of S is scaled
by its key's scale before the row max, the max by the row's query scale (a positive factor) after it.
Hopper's FP8 MMAs accumulate with fewer bits than float32 (about 13 significant bits, inside each 32-element
K step and on its running total): a model of that truncation puts FP8 scores within (16 + Dp/32) x 2^-13 of
their product magnitudes (sum_i |q_i k_i|) of the reference's float32 ones, far below the e4m3 rounding of
the operands themselves.

A CTA owns 64 consecutive query tokens of one request and W index heads that read the same index-key
head (W = Hi / Hki, at most 4): one warpgroup per index head, 64 MMA rows each, so every index-key
block it loads feeds W x 64 rows. It walks the request's blocks up to the tile's last visible one:
TMA brings each block's 128 keys into a ring of `stages` pages, each warpgroup computes S = Q K^T
(wgmma, both operands in shared memory), masks keys past each row's position (only the one or two
blocks on the tile's diagonal need it) and stores each row's max. The warpgroups run independently
(one's masking and stores overlap another's MMAs); a page is refilled once all of them released it.
Tiles are launched last first: the causal work grows along the request, so the longest tiles start
in the first wave.

Blocks past a row's position are not written: prefill_index_block_scores, its launcher, fills out
with -inf first; bind_block_scores, for top-k, which reads each row's visible blocks only, does not.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import block_scores_out, compiled_kernel
from msa_kernels.cute.warp_mma import acc_rows_cols, copy_rows, quad_reduce, row_copy, warpgroup_gemm_nt
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache, quantize_rows
from msa_kernels.plan import Workspace
from msa_kernels.shapes import MSAShape, PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

PREFILL_TILE_TOKENS = 64  # query tokens per CTA (the warpgroup MMA's M)
WARPGROUP = 128
SMEM_BYTES = 220 * 1024  # of the 227 KB a CTA may use: the rest for barriers and alignment


@dataclass(frozen=True)
class PrefillIndexScoreParams:
    num_index_heads: int  # Hi
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    block_size: int = 128  # B: keys a page
    fp8: bool = False  # an FP8 index-key cache: e4m3 queries and keys, float32 scales per row

    @property
    def operand(self) -> type[cutlass.Numeric]:
        """The MMA operands' type."""
        return cutlass.Float8E4M3FN if self.fp8 else cutlass.BFloat16

    @property
    def heads_per_cta(self) -> int:
        """W: index heads of one index-key head that share a CTA (one warpgroup each)."""
        group = self.num_index_heads // self.num_index_key_heads
        heads = max(w for w in (1, 2, 4) if group % w == 0)
        while heads > 1 and self._smem(heads, 2) > SMEM_BYTES:
            heads //= 2
        return heads

    @property
    def stages(self) -> int:
        """Index-key pages in flight: as many as fit next to the queries, up to 4."""
        return max(s for s in (1, 2, 3, 4) if s == 1 or self._smem(self.heads_per_cta, s) <= SMEM_BYTES)

    def _smem(self, heads: int, stages: int) -> int:
        return self.operand.width // 8 * self.index_head_dim * (heads * PREFILL_TILE_TOKENS + stages * self.block_size)


class PrefillIndexScoreKernel:
    def __init__(self, params: PrefillIndexScoreParams):
        assert params.num_index_heads % params.num_index_key_heads == 0
        index_key_dtype = Fp8IndexKeyCache.dtype if params.fp8 else torch.bfloat16
        assert self.can_implement(torch.bfloat16, index_key_dtype, params.index_head_dim, params.block_size)
        self.p = params

    @classmethod
    def can_implement(
        cls, dtype: torch.dtype, index_key_dtype: torch.dtype, index_head_dim: int, block_size: int
    ) -> bool:
        """bf16 index queries and a bf16 or FP8 (Fp8IndexKeyCache.dtype) index-key cache, 128-token blocks, index
        head dim a multiple of 32 (the FP8 MMA's K) up to 256."""
        return (
            dtype == torch.bfloat16
            and index_key_dtype in (torch.bfloat16, Fp8IndexKeyCache.dtype)
            and block_size == 128
            and index_head_dim % 32 == 0
            and index_head_dim <= 256
        )

    @staticmethod
    def fake_arguments(params: PrefillIndexScoreParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call; the scales are
        None for bf16."""
        f32, i32 = cutlass.Float32, cutlass.Int32
        return (
            row_major(params.operand, 3, align=16),  # index_q
            row_major(f32, 2) if params.fp8 else None,  # index_q_scales
            row_major(params.operand, 4, align=16),  # index_key_cache (FP8: its values)
            row_major(f32, 3) if params.fp8 else None,  # index_key_scales
            row_major(i32, 2),  # block_table
            row_major(i32, 1),  # token_position
            row_major(i32, 2),  # tiles
            row_major(f32, 3),  # out
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        index_q: cute.Tensor,  # [T, Hi, Dp] bf16, or e4m3
        index_q_scales: cute.Tensor | None,  # FP8: [T, Hi] float32
        index_key_cache: cute.Tensor,  # [pages, B, Hki, Dp] bf16, or e4m3 (strided pages)
        index_key_scales: cute.Tensor | None,  # FP8: [pages, B, Hki] float32
        block_table: cute.Tensor,  # [R, max_blocks] int32
        token_position: cute.Tensor,  # [T] int32
        tiles: cute.Tensor,  # [tiles, 3] int32: request, first token, end token
        out: cute.Tensor,  # [T, Hi, max_blocks] fp32, pre-filled with -inf
        stream: cuda.CUstream,
    ):
        p = self.p
        operand = p.operand
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(sm90_utils.LayoutEnum.ROW_MAJOR, operand, p.index_head_dim), operand
        )
        q_layout = cute.tile_to_shape(atom, (PREFILL_TILE_TOKENS, p.index_head_dim, p.heads_per_cta), (0, 1, 2))
        k_layout = cute.tile_to_shape(atom, (p.block_size, p.index_head_dim, p.stages), (0, 1, 2))
        # TMA over the whole cache, modes (key, d, key head, page): a (B, Dp) box is one page of one head.
        keys = cute.make_tensor(index_key_cache.iterator, cute.select(index_key_cache.layout, mode=[1, 3, 2, 0]))
        tma_atom, tma_keys = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            keys,
            cute.select(k_layout, mode=[0, 1]),
            (p.block_size, p.index_head_dim),
        )
        mma = sm90_utils.make_trivial_tiled_mma(  # S = Q K^T: both operands K-major in shared memory
            operand,
            operand,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            (1, 1, 1),
            (PREFILL_TILE_TOKENS, p.block_size),
        )
        q_copy = row_copy(operand, WARPGROUP, p.index_head_dim, cpasync.CopyG2SOp())

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, p.stages]  # TMA arrival per page
            empty: cute.struct.MemRange[cutlass.Int64, p.stages]  # every warp done with the page
            sQ: cute.struct.Align[cute.struct.MemRange[operand, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[operand, cute.cosize(k_layout)], 1024]

        self.kernel(
            index_q,
            index_q_scales,
            tma_keys,
            index_key_scales,
            block_table,
            token_position,
            tiles,
            out,
            tma_atom,
            mma,
            q_copy,
            q_layout,
            k_layout,
            Storage,
        ).launch(
            grid=[cute.size(tiles, mode=[0]), p.num_index_heads // p.heads_per_cta, 1],
            block=[WARPGROUP * p.heads_per_cta, 1, 1],
            smem=Storage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        index_q: cute.Tensor,
        index_q_scales: cute.Tensor | None,
        tma_keys: cute.Tensor,
        index_key_scales: cute.Tensor | None,
        block_table: cute.Tensor,
        token_position: cute.Tensor,
        tiles: cute.Tensor,
        out: cute.Tensor,
        tma_atom: cute.CopyAtom,
        mma: cute.TiledMma,
        q_copy: cute.TiledCopy,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        Storage: cutlass.Constexpr,
    ):
        p = self.p
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        launch_tile, head_group, _ = cute.arch.block_idx()
        num_tiles, _, _ = cute.arch.grid_dim()
        tile = num_tiles - 1 - launch_tile  # the request's last (longest) tiles first
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        group = warp // 4  # warpgroup: one index head
        wg_tidx = tidx % WARPGROUP
        head = head_group * p.heads_per_cta + group
        key_head = head // (p.num_index_heads // p.num_index_key_heads)
        request = tiles[tile, 0]
        first_token = tiles[tile, 1]
        num_rows = tiles[tile, 2] - first_token
        earliest = token_position[first_token]
        num_blocks = token_position[first_token + num_rows - 1] // p.block_size + 1
        tx_bytes = p.block_size * p.index_head_dim * p.operand.width // 8

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        # wgmma takes affine shared-memory layouts: the swizzle goes into the pointer.
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)

        gK = cute.local_tile(tma_keys[None, None, key_head, None], (p.block_size, p.index_head_dim), (0, 0, None))
        tKs, tKg = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        if warp == 0:
            cpasync.prefetch_descriptor(tma_atom)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(p.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, 4 * p.heads_per_cta)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # barriers initialised before any thread uses them
        if warp == 0:
            for s in cutlass.range_constexpr(p.stages):
                if s < num_blocks:
                    self.load_page(tma_atom, tKg, tKs, full, block_table[request, s], s, tx_bytes)

        # This warpgroup's index queries; rows past the request's tokens are zero and never stored.
        tile_shape = (PREFILL_TILE_TOKENS, p.index_head_dim)
        gQ = cute.local_tile(cute.domain_offset((first_token, 0), index_q[None, head, None]), tile_shape, (0, 0))
        thr_copy = q_copy.get_slice(wg_tidx)
        copy_rows(q_copy, thr_copy, gQ, sQ[None, None, group], num_rows, tile_shape)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, then read by wgmma (async proxy)
        cute.arch.sync_threads()

        thr_mma = mma.get_slice(wg_tidx)
        tSrQ = mma.make_fragment_A(thr_mma.partition_A(sQ[None, None, group]))
        tSrK = mma.make_fragment_B(thr_mma.partition_B(sK))
        score_coords = acc_rows_cols(
            thr_mma.partition_C(cute.make_identity_tensor((PREFILL_TILE_TOKENS, p.block_size)))
        )
        rows = cute.size(score_coords, mode=[0])
        row_position = cute.make_rmem_tensor((rows,), cutlass.Int32)  # -1 past the request's tokens
        row_scale = cute.make_rmem_tensor((rows,), f32)  # FP8: the row's query scale
        for r in cutlass.range_constexpr(rows):
            row_position[r] = -1
            row_scale[r] = 1.0
            if score_coords[r, 0][0] < num_rows:
                row_position[r] = token_position[first_token + score_coords[r, 0][0]]
                if cutlass.const_expr(p.fp8):
                    row_scale[r] = index_q_scales[first_token + score_coords[r, 0][0], head]
        cols = cute.size(score_coords, mode=[1])
        if cutlass.const_expr(p.fp8):
            key_scale = cute.make_rmem_tensor((cols,), f32)  # the scales of this thread's key columns
            # The page of the next block, read a block ahead, so the scale loads of a block wait on one memory
            # round trip (hidden behind the page's arrival and the MMAs) instead of two in a row.
            next_page = block_table[request, 0]

        for block in cutlass.range(num_blocks, unroll=1):
            stage = block % p.stages
            # The producer refills the page released one block ago, once every warp is done with it.
            if warp == 0 and block > 0 and block - 1 + p.stages < num_blocks:
                released = (block - 1) % p.stages
                cute.arch.mbarrier_wait(empty + released, ((block - 1) // p.stages) % 2)
                self.load_page(tma_atom, tKg, tKs, full, block_table[request, block - 1 + p.stages], released, tx_bytes)
            if cutlass.const_expr(p.fp8):  # loads in flight while the page arrives and the MMAs run
                page = next_page
                for c in cutlass.range_constexpr(cols):
                    key_scale[c] = index_key_scales[page, score_coords[0, c][1], key_head]
                next_page = block_table[request, cutlass.min(block + 1, num_blocks - 1)]
            cute.arch.mbarrier_wait(full + stage, (block // p.stages) % 2)

            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((PREFILL_TILE_TOKENS, p.block_size)), f32)
            warpgroup_gemm_nt(mma, acc, tSrQ, tSrK, stage)
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + stage)

            # Each row's max over the keys it sees; masks only where the block reaches past the
            # tile's first token.
            acc_mn = acc_rows_cols(acc)
            if cutlass.const_expr(p.fp8):
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(cols):
                        acc_mn[r, c] = acc_mn[r, c] * key_scale[c]
            first_key = block * p.block_size
            diagonal = first_key + p.block_size - 1 > earliest
            for r in cutlass.range_constexpr(rows):
                best = -f32.inf
                if diagonal:
                    for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                        if first_key + score_coords[r, c][1] <= row_position[r]:
                            best = cute.arch.fmax(best, acc_mn[r, c])
                else:
                    best = acc_mn[r, None].load().reduce(cute.ReductionOp.MAX, -f32.inf, 0)
                best = quad_reduce(best, cute.arch.fmax)
                if lane % 4 == 0 and first_key <= row_position[r]:
                    out[first_token + score_coords[r, 0][0], head, block] = best * row_scale[r]

    @cute.jit
    def load_page(self, tma_atom, tKg, tKs, full, page, stage, tx_bytes: cutlass.Constexpr):
        """TMA one page of index keys into `stage`; arrival on that stage's barrier (warp 0 calls)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, tx_bytes)
        cute.copy(tma_atom, tKg[None, page], tKs[None, stage], tma_bar_ptr=full + stage)


def prefill_index_block_scores(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor | Fp8IndexKeyCache,
    batch: PagedBatch,
    shape: MSAShape,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.index_block_scores, for bf16 index queries and a bf16 or FP8
    index-key cache on Hopper: each request's tokens in tiles of PREFILL_TILE_TOKENS. With FP8 keys the
    queries are rounded to e4m3 here, per token and index head (quantize_rows, the reference's rounding)."""
    size = (batch.num_tokens, shape.num_index_heads, batch.block_table.shape[1])
    out = torch.full(size, float("-inf"), dtype=torch.float32, device=index_q.device)
    return _launch(batch, shape, out)(index_q, index_key_cache)


def bind_block_scores(
    batch: PagedBatch, shape: MSAShape, workspace: Workspace | None = None
) -> Callable[[torch.Tensor, torch.Tensor | Fp8IndexKeyCache], torch.Tensor]:
    """prefill_index_block_scores for top-k, bound to a batch (what a step's layers share worked out once):
    (index_q, index_key_cache) -> the block scores in the workspace's (runtime.block_scores_out), with the blocks
    past each token's position left as the memory held them (top-k reads a row's visible blocks only): no write of
    the whole tensor (1 GiB per 64K tokens of a 128K context)."""
    return _launch(batch, shape, block_scores_out(batch, shape.num_index_heads, workspace))


def _launch(
    batch: PagedBatch, shape: MSAShape, out: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor | Fp8IndexKeyCache], torch.Tensor]:
    batch_inputs = (batch.block_table, batch.positions, batch.request_tiles(PREFILL_TILE_TOKENS), out)
    kernels: dict[bool, tvm_ffi.Function] = {}  # by FP8 keys, each compiled or loaded at its first call

    def launch(index_q: torch.Tensor, index_key_cache: torch.Tensor | Fp8IndexKeyCache) -> torch.Tensor:
        fp8 = isinstance(index_key_cache, Fp8IndexKeyCache)
        if fp8:
            operands = (*quantize_rows(index_q), index_key_cache.values, index_key_cache.scales)
        else:
            operands = (index_q.contiguous(), None, index_key_cache, None)
        kernel = kernels.get(fp8) or kernels.setdefault(fp8, _kernel(shape, fp8))
        kernel(*operands, *batch_inputs)
        return out

    return launch


@functools.cache
def _kernel(shape: MSAShape, fp8: bool) -> "tvm_ffi.Function":
    params = PrefillIndexScoreParams(
        shape.num_index_heads, shape.num_index_key_heads, shape.index_head_dim, shape.block_size, fp8
    )
    return compiled_kernel(PrefillIndexScoreKernel, params)
