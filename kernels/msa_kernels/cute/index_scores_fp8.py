"""CuTeDSL kernel: causal max-pooled index block scores against an FP8 index-key cache, on tensor cores.

Computes reference.index_block_scores on msa_kernels.fp8_index_keys' pages (e4m3 values, a float32 scale per
key): out[t, h, b] = max over visible keys j of block b of q8[t, h] . k8[j, h // (Hi / Hki)] x key scale x
query scale, -inf for blocks with no visible key, where q8 is the index query rounded to e4m3 as the reference
rounds it (fp8_rows.quantize_row_slice, per token and index head).

One CTA (4 warps) per (logical block, query token): the dots of the block's 128 key rows with the query's
index heads are one [128 x Dp] x [Dp x heads] product on tensor cores (mma.sync m16n8k16 on f16, fp32
accumulate; every e4m3 value is an f16 value, so the products are exactly q8 * k8 and the sums float32),
each warp 32 rows (two 16-row tiles), the heads that share an index-key head the MMA's 8 columns. Every key
load of the CTA is issued before the first MMA, as cp.async into the lane's own shared-memory slots, which it
reads back and widens into the MMA's A registers; the query rows are rounded meanwhile (memory bound at long
context: one read of each page per query token, the whole page in flight). A dot is a sum over the head dim in
any order, so each lane feeds the MMA the dims of its own 16-byte loads: lane (g, c) = (lane // 4, lane % 4) of
a row tile loads rows g and g + 8 at the dims of chunks 4 l + c (l = 0 .. loads per row - 1; 8-byte chunks for
rows under 64 bytes), so the 4 lanes of a row read 64 contiguous bytes and no shuffles sum partial dots. Its
query registers (the B operand) hold the same dims of head g. A row's dot is scaled by its key's scale before
the max over rows (a running max over the lane's tiles, then 3 shuffles across a warp's rows and a [warps, Hi]
shared-memory exchange) and by the query's scale after it (a positive factor: the max is the same).

Measured against the SIMT kernel on these pages (H200, M3 shapes, results/README.md seventh session): 2.3x
faster at 128K x 32 (179 us, 73% of the copy bandwidth), as fast at batch 1. The bf16 pages keep
index_scores.py's SIMT kernel: this design on bf16 keys reached 74% of the copy bandwidth at 128K x 32 where
the SIMT kernel reaches 90%. fp8_index_block_scores launches it (decode parts).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync, warp

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.fp8_rows import quantize_row_slice
from msa_kernels.cute.pdl import wait_for_previous_kernel
from msa_kernels.cute.runtime import block_scores_out, compiled_kernel
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.plan import Workspace
from msa_kernels.shapes import MSAShape, PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

WARPS = 4
ROW_TILE = 16  # key rows per MMA: its M
HEAD_TILE = 8  # index heads per MMA: its N
LANES_PER_ROW = 4  # lanes that share a key row (a quad: the MMA's A layout)
MMA_DIMS = 4  # head dims of one row that a lane feeds one MMA step (two 32-bit registers of 16-bit values)
MMA_DTYPE = cutlass.Float16  # e4m3 keys and queries widen to it exactly


@dataclass(frozen=True)
class Fp8IndexScoreParams:
    num_index_heads: int  # Hi
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    block_size: int = 128  # B: key rows per CTA

    @property
    def load_bytes(self) -> int:
        """Bytes of one key row a lane loads at once: 16, or 8 for rows under 64 bytes."""
        return load_bytes(self.index_head_dim)

    @property
    def vec(self) -> int:
        """Key elements (e4m3, a byte each) per load."""
        return self.load_bytes

    @property
    def loads_per_row(self) -> int:
        """Loads of one key row per lane."""
        return self.index_head_dim // (self.vec * LANES_PER_ROW)

    @property
    def heads_per_key(self) -> int:
        return self.num_index_heads // self.num_index_key_heads

    @property
    def head_tiles(self) -> int:
        return -(-self.heads_per_key // HEAD_TILE)

    @property
    def row_tiles_per_warp(self) -> int:
        return self.block_size // (ROW_TILE * WARPS)


def load_bytes(row_bytes: int) -> int:
    return 16 if row_bytes >= 16 * LANES_PER_ROW else 8


class Fp8IndexScoreKernel:
    threads = WARPS * 32

    def __init__(self, params: Fp8IndexScoreParams):
        assert params.num_index_heads % params.num_index_key_heads == 0
        assert self.can_implement(torch.bfloat16, Fp8IndexKeyCache.dtype, params.index_head_dim, params.block_size)
        self.p = params

    @classmethod
    def can_implement(
        cls, dtype: torch.dtype, index_key_dtype: torch.dtype, index_head_dim: int, block_size: int
    ) -> bool:
        """bf16 index queries; an FP8 index-key cache (Fp8IndexKeyCache.dtype); 128-token blocks; key rows in whole
        loads of 4 lanes (Dp a multiple of 32)."""
        if dtype != torch.bfloat16 or index_key_dtype != Fp8IndexKeyCache.dtype:
            return False
        return block_size == 128 and index_head_dim % (load_bytes(index_head_dim) * LANES_PER_ROW) == 0

    @staticmethod
    def fake_arguments(params: Fp8IndexScoreParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        return (
            row_major(bf16, 3, align=16),  # index_q
            row_major(cutlass.Float8E4M3FN, 4, align=16),  # index_keys
            row_major(cutlass.Float32, 3),  # index_key_scales
            row_major(i32, 2),  # block_table
            row_major(i32, 1),  # token_request
            row_major(i32, 1),  # token_position
            row_major(cutlass.Float32, 3),  # out
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        index_q: cute.Tensor,  # [T, Hi, Dp] bf16
        index_keys: cute.Tensor,  # [pages, B, Hki, Dp] e4m3
        index_key_scales: cute.Tensor,  # [pages, B, Hki] fp32
        block_table: cute.Tensor,  # [R, max_blocks] int32
        token_request: cute.Tensor,  # [T] int32
        token_position: cute.Tensor,  # [T] int32
        out: cute.Tensor,  # [T, Hi, max_blocks] fp32
        stream: cuda.CUstream,
    ):
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(MMA_DTYPE, cutlass.Float32, (ROW_TILE, HEAD_TILE, 16)))
        num_tokens = cute.size(index_q, mode=[0])
        max_blocks = cute.size(block_table, mode=[1])
        self.kernel(index_q, index_keys, index_key_scales, block_table, token_request, token_position, out, mma).launch(
            grid=[num_tokens, max_blocks, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        index_q: cute.Tensor,
        index_keys: cute.Tensor,
        index_key_scales: cute.Tensor | None,
        block_table: cute.Tensor,
        token_request: cute.Tensor,
        token_position: cute.Tensor,
        out: cute.Tensor,
        mma: cute.TiledMma,
    ):
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        p = self.p
        f32, i32 = cutlass.Float32, cutlass.Int32
        tidx, _, _ = cute.arch.thread_idx()
        token, block, _ = cute.arch.block_idx()
        warp_idx = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        g, c = lane // LANES_PER_ROW, lane % LANES_PER_ROW  # the lane's rows (g, g + 8) and chunk column

        smem = cutlass.memory.SmemAllocator()
        partial_max = smem.allocate_tensor(
            f32, cute.make_layout((WARPS, p.num_index_heads), stride=(p.num_index_heads, 1))
        )
        query_scale = smem.allocate_tensor(f32, cute.make_layout((p.num_index_heads,)))
        key_dtype = index_keys.element_type
        slots = p.num_index_key_heads * p.row_tiles_per_warp * 2 * p.loads_per_row
        key_slots = smem.allocate_tensor(  # [vec, slot, thread]: a warp's reads of one slot are contiguous
            key_dtype,
            cute.make_layout((p.vec, slots, self.threads), stride=(1, self.threads * p.vec, p.vec)),
            byte_alignment=16,
        )
        # cp.async.cg (past L1) takes only 16-byte copies; 8-byte ones go through L1 (.ca)
        cache_mode = cpasync.LoadCacheMode.GLOBAL if p.load_bytes == 16 else cpasync.LoadCacheMode.ALWAYS
        load_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cache_mode), key_dtype, num_bits_per_copy=p.load_bytes * 8
        )

        position = token_position[token]
        neg_inf = f32(-f32.inf)
        if block * p.block_size <= position:
            page = block_table[token_request[token], block]
            thr_mma = mma.get_slice(lane)
            steps = p.loads_per_row * p.vec // MMA_DIMS  # MMA steps of a row tile: Dp / 16
            # Every key load of the CTA first, cp.async into this lane's own shared-memory slots (no registers
            # held, so all of them are in flight at once): [key head][row tile][row g, g + 8][load].
            for kh in cutlass.range_constexpr(p.num_index_key_heads):
                for t in cutlass.range_constexpr(p.row_tiles_per_warp):
                    for half in cutlass.range_constexpr(2):
                        row = (warp_idx * p.row_tiles_per_warp + t) * ROW_TILE + half * 8 + g
                        for ld in cutlass.range_constexpr(p.loads_per_row):
                            chunk = cute.zipped_divide(index_keys[page, row, kh, None], (p.vec,))[
                                (None, ld * LANES_PER_ROW + c)
                            ]
                            slot = ((kh * p.row_tiles_per_warp + t) * 2 + half) * p.loads_per_row + ld
                            cute.copy(load_atom, chunk, key_slots[None, slot, tidx])
            cute.arch.cp_async_commit_group()
            queries = []  # [key head][head tile]
            for kh in cutlass.range_constexpr(p.num_index_key_heads):
                # The query heads of each key head as B operands, while the keys are in flight (lane (g, c): head g
                # of the tile, chunks 4 l + c).
                queries.append([])
                for n in cutlass.range_constexpr(p.head_tiles):
                    head = kh * p.heads_per_key + cutlass.min(n * HEAD_TILE + g, p.heads_per_key - 1)
                    q_row = cute.make_rmem_tensor((p.loads_per_row * p.vec,), f32)
                    for ld in cutlass.range_constexpr(p.loads_per_row):
                        chunk = cute.zipped_divide(index_q[token, head, None], (p.vec,))[(None, ld * LANES_PER_ROW + c)]
                        frag = cute.make_fragment_like(chunk)
                        cute.autovec_copy(chunk, frag)
                        _chunk(q_row, p.vec, ld).store(frag.load().to(f32))
                    q8, scale = quantize_row_slice(q_row.load(), LANES_PER_ROW)
                    if c == 0:  # noqa: SIM102 (dynamic conditions: one scf.if each)
                        if n * HEAD_TILE + g < p.heads_per_key:
                            query_scale[head] = scale
                    q_mma = cute.make_rmem_tensor((p.loads_per_row * p.vec,), MMA_DTYPE)
                    q_mma.store(q8.to(MMA_DTYPE))
                    queries[kh].append(cute.recast_tensor(q_mma, i32))
            cute.arch.cp_async_wait_group(0)  # each lane reads back only its own slots
            for kh in cutlass.range_constexpr(p.num_index_key_heads):
                keys = []
                for i in cutlass.range_constexpr(p.row_tiles_per_warp * 2 * p.loads_per_row):
                    slot = key_slots[None, kh * p.row_tiles_per_warp * 2 * p.loads_per_row + i, tidx]
                    frag = cute.make_fragment_like(slot)
                    cute.autovec_copy(slot, frag)
                    keys.append(frag)
                best = cute.make_rmem_tensor((p.head_tiles, 2), f32)
                best.fill(neg_inf)
                for t in cutlass.range_constexpr(p.row_tiles_per_warp):
                    row0 = (warp_idx * p.row_tiles_per_warp + t) * ROW_TILE + g
                    # the tile's two rows of this lane, widened to the MMA's 16-bit type, as 32-bit registers
                    rows = []
                    for half in cutlass.range_constexpr(2):
                        wide = cute.make_rmem_tensor((p.loads_per_row * p.vec,), MMA_DTYPE)
                        for ld in cutlass.range_constexpr(p.loads_per_row):
                            frag = keys[(t * 2 + half) * p.loads_per_row + ld]
                            _chunk(wide, p.vec, ld).store(frag.load().to(MMA_DTYPE))
                        rows.append(cute.recast_tensor(wide, i32))
                    for n in cutlass.range_constexpr(p.head_tiles):
                        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROW_TILE, HEAD_TILE)), f32)
                        acc.fill(0.0)
                        for s in cutlass.range_constexpr(steps):
                            a = cute.make_rmem_tensor(thr_mma.partition_shape_A((ROW_TILE, 16)), MMA_DTYPE)
                            b = cute.make_rmem_tensor(thr_mma.partition_shape_B((HEAD_TILE, 16)), MMA_DTYPE)
                            a32, b32 = cute.recast_tensor(a, i32), cute.recast_tensor(b, i32)
                            # A: (row g, dims lo), (row g + 8, lo), (row g, hi), (row g + 8, hi); B: (head g, lo), (hi)
                            a32[0], a32[1] = rows[0][2 * s], rows[1][2 * s]
                            a32[2], a32[3] = rows[0][2 * s + 1], rows[1][2 * s + 1]
                            b32[0], b32[1] = queries[kh][n][2 * s], queries[kh][n][2 * s + 1]
                            cute.gemm(mma, acc, a, b, acc)
                        # acc: (row g, heads 2c, 2c + 1), (row g + 8, same heads)
                        for half in cutlass.range_constexpr(2):
                            row = row0 + half * 8
                            visible = block * p.block_size + row <= position
                            for col in cutlass.range_constexpr(2):
                                score = acc[half * 2 + col] * index_key_scales[page, row, kh]
                                if visible:
                                    best[n, col] = cute.arch.fmax(best[n, col], score)
                for n in cutlass.range_constexpr(p.head_tiles):
                    for col in cutlass.range_constexpr(2):
                        score = best[n, col]
                        for i in cutlass.range_constexpr(3):  # across the lanes' rows g: lane offsets 4, 8, 16
                            score = cute.arch.fmax(
                                score, cute.arch.shuffle_sync_bfly(score, offset=4 << i, mask=-1, mask_and_clamp=31)
                            )
                        head = n * HEAD_TILE + 2 * c + col
                        if g == 0:  # noqa: SIM102 (dynamic conditions: one scf.if each)
                            if head < p.heads_per_key:
                                partial_max[warp_idx, kh * p.heads_per_key + head] = score
            cute.arch.sync_threads()
            if tidx < p.num_index_heads:
                block_max = partial_max[0, tidx]
                for w in cutlass.range_constexpr(1, WARPS):
                    block_max = cute.arch.fmax(block_max, partial_max[w, tidx])
                out[token, tidx, block] = block_max * query_scale[tidx]
        else:
            if tidx < p.num_index_heads:
                out[token, tidx, block] = neg_inf


def _chunk(row: cute.Tensor, vec: int, index: int) -> cute.Tensor:
    """Elements [index * vec, (index + 1) * vec) of a register row."""
    return cute.zipped_divide(row, (vec,))[(None, index)]


def fp8_index_block_scores(
    index_q: torch.Tensor,
    index_key_cache: Fp8IndexKeyCache,
    batch: PagedBatch,
    shape: MSAShape,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.index_block_scores, for bf16 index queries and an FP8 index-key cache
    on Hopper: every token on its own. workspace: into its block scores (runtime.block_scores_out)."""
    return bind_block_scores(batch, shape, workspace)(index_q, index_key_cache)


def bind_block_scores(
    batch: PagedBatch, shape: MSAShape, workspace: Workspace | None = None
) -> Callable[[torch.Tensor, Fp8IndexKeyCache], torch.Tensor]:
    """fp8_index_block_scores bound to a batch (what a step's layers share worked out once): (index_q,
    index_key_cache) -> the block scores."""
    out = block_scores_out(batch, shape.num_index_heads, workspace)
    kernel = _kernel(shape)
    batch_inputs = (batch.block_table, batch.token_requests, batch.positions)

    def launch(index_q: torch.Tensor, index_key_cache: Fp8IndexKeyCache) -> torch.Tensor:
        kernel(index_q.contiguous(), index_key_cache.values, index_key_cache.scales, *batch_inputs, out)
        return out

    return launch


@functools.cache
def _kernel(shape: MSAShape) -> "tvm_ffi.Function":
    params = Fp8IndexScoreParams(
        shape.num_index_heads, shape.num_index_key_heads, shape.index_head_dim, shape.block_size
    )
    return compiled_kernel(Fp8IndexScoreKernel, params)
