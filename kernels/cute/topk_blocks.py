"""CuTeDSL kernel: top-k block selection from the index block scores.

Computes reference.topk_blocks: per (query token, index head) row, the forced blocks (the query's
block and the local_blocks-1 before it, the init blocks) and the best `need` = K - forced of the
other visible blocks, ascending, -1 padded. One CTA (128 threads) per row.

The scores arrive as their fp32 bit patterns (int32); key = bits, or bits ^ 0x7fffffff for negative
ones, orders them as the floats. The need-th largest candidate key is built bit by bit from the top:
the sign, then each lower bit kept if at least `need` candidates have a key >= the value with it
set (one CTA-wide count per bit, 32 in all, and one more for the candidates above the result, which
says how many equal to it to keep). A last pass walks the blocks in order and keeps
the forced ones, the candidates above the threshold and the first candidates equal to it, so ties
go to the lower block number and the output comes out sorted. Rows with no more candidates than
slots skip the search and take every visible block. topk_blocks launches it.

Threads per row (TopkBlocksParams.row_threads): a CTA of 128-1024 threads per row, whose counts and prefixes
cross warps through shared memory with a CTA barrier each, or one warp per row (32: a CTA of 4 warps holds 4
index heads of a token), whose counts and prefixes are warp reductions and ballots with no barrier: fewer
threads per row, but many rows (prefill, large decode batches) keep every SM busy anyway.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel, contiguous_out, copy_into
from msa_kernels.shapes import MSAShape

if TYPE_CHECKING:
    import tvm_ffi

WARP = 32
CTA_THREADS = 128  # threads of a CTA of warp rows (4 rows), and the default threads per row
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TopkBlocksParams:
    topk_blocks: int  # K
    local_blocks: int  # L
    init_blocks: int  # I
    block_size: int = 128  # B
    row_threads: int = CTA_THREADS  # threads per (token, index head) row: 32 (a warp) or a CTA of 128-1024

    @property
    def warp_rows(self) -> bool:
        return self.row_threads == WARP

    @property
    def rows_per_cta(self) -> int:
        return CTA_THREADS // WARP if self.warp_rows else 1

    @property
    def cta_threads(self) -> int:
        return CTA_THREADS if self.warp_rows else self.row_threads


class TopkBlocksKernel:
    def __init__(self, params: TopkBlocksParams):
        assert params.topk_blocks >= params.local_blocks + params.init_blocks and params.local_blocks >= 1
        assert params.row_threads in (32, 128, 256, 512, 1024)
        self.p = params

    @classmethod
    def can_implement(cls, dtype: torch.dtype) -> bool:
        """fp32 block scores (read as their bit patterns); any K, L, I and block size."""
        return dtype == torch.float32

    @staticmethod
    def fake_arguments(params: TopkBlocksParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        i32 = cutlass.Int32
        return (row_major(i32, 3), row_major(i32, 1), row_major(i32, 3), env_stream())

    @cute.jit
    def __call__(
        self,
        score_bits: cute.Tensor,  # [T, Hi, max_blocks] int32: the fp32 block scores' bits
        token_position: cute.Tensor,  # [T] int32, -1 for padding tokens (they select nothing)
        out: cute.Tensor,  # [T, Hi, K] int32
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(score_bits, mode=[0])
        num_heads = cute.size(score_bits, mode=[1])
        head_groups = (num_heads + self.p.rows_per_cta - 1) // self.p.rows_per_cta
        self.kernel(score_bits, token_position, out).launch(
            grid=[num_tokens, head_groups, 1], block=[self.p.cta_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, score_bits: cute.Tensor, token_position: cute.Tensor, out: cute.Tensor):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        token, head_group, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        head, t = head_group, tidx  # the row, and this thread's index in it
        exchange = None  # the CTA's per-warp partial counts (CTA rows)
        if cutlass.const_expr(p.warp_rows):
            head, t = head_group * p.rows_per_cta + warp, lane
        else:
            smem = cutlass.memory.SmemAllocator()
            exchange = smem.allocate_tensor(cutlass.Int32, cute.make_layout((p.row_threads // WARP,)))
        if head < cute.size(score_bits, mode=[1]):
            self.select_row(score_bits, token_position, out, token, head, t, warp, lane, exchange)

    @cute.jit
    def select_row(self, score_bits, token_position, out, token, head, t, warp, lane, exchange):
        """Top-k of one (token, index head) row by its row_threads threads, t = 0 .. row_threads - 1."""
        p = self.p
        row = score_bits[token, head, None]

        # Visible blocks [0, visible), forced ones: [0, init_end) and [local_start, visible).
        position = token_position[token]
        visible = cutlass.Int32(0)
        if position >= 0:
            visible = cutlass.min(position // p.block_size + 1, cute.size(score_bits, mode=[2]))
        local_start = cutlass.max(visible - p.local_blocks, 0)
        init_end = cutlass.min(visible, p.init_blocks)
        forced = visible
        if init_end <= local_start:
            forced = init_end + visible - local_start
        need = p.topk_blocks - forced
        # Candidates keep a block if key > threshold, or key == threshold among the first `need_equal`.
        threshold = cutlass.Int32(INT32_MIN)
        need_equal = visible
        if need == 0:
            threshold = cutlass.Int32(INT32_MAX)
            need_equal = cutlass.Int32(0)
        if need > 0 and visible - forced > need:
            threshold = cutlass.Int32(0)
            if self.count_at_least(row, threshold, init_end, local_start, t, exchange, warp) < need:
                threshold = cutlass.Int32(INT32_MIN)
            for bit in cutlass.range_constexpr(30, -1, -1):
                trial = threshold | (1 << bit)
                if self.count_at_least(row, trial, init_end, local_start, t, exchange, warp) >= need:
                    threshold = trial
            need_equal = need - self.count_at_least(row, threshold + 1, init_end, local_start, t, exchange, warp)

        # Keep blocks in order, row_threads at a time; warp ballots + a row prefix give each its slot.
        taken = cutlass.Int32(0)
        equal_seen = cutlass.Int32(0)
        lanes_below = (cutlass.Int32(1) << lane) - 1
        for start in range(0, visible, p.row_threads):
            block = start + t
            keep = cutlass.Int32(0)
            equal = cutlass.Int32(0)
            if block < visible:
                keep = 1
                if block >= init_end and block < local_start:
                    key = self.order_key(row[block])
                    keep = 0
                    if key > threshold:
                        keep = 1
                    if key == threshold:
                        equal = 1
            equal_ballot = cute.arch.vote_ballot_sync(equal != 0)
            equal_rank, equal_total = self.row_prefix(equal_ballot, lanes_below, exchange, warp)
            if equal != 0 and equal_seen + equal_rank < need_equal:
                keep = 1
            keep_ballot = cute.arch.vote_ballot_sync(keep != 0)
            slot, kept = self.row_prefix(keep_ballot, lanes_below, exchange, warp)
            if keep != 0:
                out[token, head, taken + slot] = block
            taken += kept
            equal_seen += equal_total
        for slot in range(taken + t, p.topk_blocks, p.row_threads):
            out[token, head, slot] = -1

    @cute.jit
    def order_key(self, bits: cutlass.Int32) -> cutlass.Int32:
        """The float's order as a signed int: negative floats have their magnitude bits flipped."""
        key = bits
        if bits < 0:
            key = bits ^ INT32_MAX
        return key

    @cute.jit
    def count_at_least(self, row, threshold, init_end, local_start, t, exchange, warp) -> cutlass.Int32:
        """Candidates (blocks in [init_end, local_start)) with key >= threshold, summed over the row's threads."""
        count = cutlass.Int32(0)
        for block in range(init_end + t, local_start, self.p.row_threads):
            if self.order_key(row[block]) >= threshold:
                count += 1
        count = cute.arch.warp_redux_sync(count, "add")
        if cutlass.const_expr(not self.p.warp_rows):
            cute.arch.sync_threads()  # the previous exchange is read by every warp
            if cute.arch.lane_idx() == 0:
                exchange[warp] = count
            cute.arch.sync_threads()
            count = exchange[0]
            for w in cutlass.range_constexpr(1, self.p.row_threads // WARP):
                count += exchange[w]
        return count

    @cute.jit
    def row_prefix(self, ballot, lanes_below, exchange, warp):
        """(set bits of the ballots of the row's lower threads, set bits in the whole row)."""
        below = cute.arch.popc(ballot & lanes_below)
        total = cute.arch.popc(ballot)
        if cutlass.const_expr(not self.p.warp_rows):
            cute.arch.sync_threads()
            if cute.arch.lane_idx() == 0:
                exchange[warp] = total
            cute.arch.sync_threads()
            total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(self.p.row_threads // WARP):
                if w < warp:
                    below += exchange[w]
                total += exchange[w]
        return below, total


def topk_blocks(
    scores: torch.Tensor,
    positions: torch.Tensor,
    shape: MSAShape,
    out: torch.Tensor | None = None,
    row_threads: int = CTA_THREADS,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.topk_blocks, for fp32 scores and int32 positions (as
    PagedBatch.positions) on Hopper; ties go to the lower block number. out: [T, Hi, K] int32 to write
    (a slice of a step's selection), else a new tensor. row_threads: threads per row (TopkBlocksParams;
    kernels/bench/bench_topk.py times the choices)."""
    num_tokens, num_heads, _ = scores.shape
    result = contiguous_out(out, (num_tokens, num_heads, shape.topk_blocks), torch.int32, scores.device)
    if num_tokens:
        _kernel(shape, row_threads)(scores.contiguous().view(torch.int32), positions, result)
    return copy_into(result, out)


@functools.cache
def _kernel(shape: MSAShape, row_threads: int) -> "tvm_ffi.Function":
    params = TopkBlocksParams(
        shape.topk_blocks, shape.local_blocks, shape.init_blocks, shape.block_size, row_threads=row_threads
    )
    return compiled_kernel(TopkBlocksKernel, params)
