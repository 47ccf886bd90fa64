"""CuTeDSL kernel: top-k block selection from the index block scores.

Computes reference.topk_blocks: per (query token, index head) row, the forced blocks (the query's
block and the local_blocks-1 before it, the init blocks) and the best `need` = K - forced of the
other visible blocks, ascending, -1 padded. topk_blocks launches it.

The scores arrive as their fp32 bit patterns (int32); key = bits, or (bits ^ 0x7fffffff) + 1 for negative
ones, orders them as the floats (-0.0 and +0.0 both key 0: equal, as the reference ranks them). The need-th
largest candidate key is found by a radix select over the key's four bytes, highest first: per byte, a
shared-memory histogram of the candidates that match the bytes found so far (warp-aggregated atomics: lanes
holding the same byte add once), then a scan of its 256 bins from the top finds the byte where the count
reaches `need`, and `need` drops by the candidates above it. The search stops at the first byte whose bin
holds exactly the `need` candidates still wanted (random scores: after about two of the four passes): every
key in that bin's range is kept. Else, after the last byte, `need` is how many candidates equal to the
threshold to keep. A last pass gives each thread a contiguous run of the row's blocks: it counts the forced
blocks, the candidates above the threshold and those equal to it; one row-wide scan of the counts gives each
thread its output slot and its share of the equal ones (ties go to the lower block number), so the output
comes out sorted. Rows with no more candidates than slots skip the search and take every visible block.

Threads per row (TopkBlocksParams.row_threads): a CTA of 128-1024 threads per row, whose histograms and
scans cross warps through shared memory with a CTA barrier each, or one warp per row (32: a CTA of 4 warps
holds 4 index heads of a token, each warp with its own histogram), synchronised by warp barriers only:
fewer threads per row, but many rows (prefill, large decode batches) keep every SM busy anyway.
bench/bench_topk.py times the choices.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.pdl import wait_for_previous_kernel
from msa_kernels.cute.runtime import compiled_kernel, contiguous_out, copy_into
from msa_kernels.shapes import MSAShape, Phase

if TYPE_CHECKING:
    import tvm_ffi

WARP = 32
CTA_THREADS = 128  # threads of a CTA of warp rows (4 rows)
BINS = 256  # one radix digit: a byte of the key
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed int the kernel's Int32 arithmetic holds."""
    return value - (1 << 32) if value >= 1 << 31 else value


def row_threads(phase: Phase, max_blocks: int) -> int:
    """Threads per row, as bench_topk.py measured on the H200 (M3's top-16): prefill rows are many, a warp each
    (2.28 ms at 128K against 2.56 ms with a CTA of 128); a decode row gets a thread per block from 128 up to 512
    (8K context: 128, 32K: 256, 128K and 1M: 512)."""
    if phase == "prefill":
        return WARP
    return min(512, max(CTA_THREADS, 1 << (max_blocks - 1).bit_length()))


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

    @property
    def row_warps(self) -> int:
        return self.row_threads // WARP

    @property
    def bins_per_thread(self) -> int:
        return max(1, BINS // self.row_threads)


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
            grid=[num_tokens, head_groups, 1], block=[self.p.cta_threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, score_bits: cute.Tensor, token_position: cute.Tensor, out: cute.Tensor):
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        token, head_group, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        # Per row: its histogram, the warps' totals of a row-wide scan (two values each), the bin found
        # (its byte, the candidates above it, the candidates in it; padded to 4 words).
        hist = smem.allocate_tensor(
            cutlass.Int32, cute.make_layout((p.rows_per_cta, BINS), stride=(BINS, 1)), byte_alignment=16
        )  # row-major: a row's bins are contiguous, as its atomics address them
        exchange = smem.allocate_tensor(cutlass.Int32, cute.make_layout((p.rows_per_cta, 2, p.row_warps)))
        found = smem.allocate_tensor(cutlass.Int32, cute.make_layout((p.rows_per_cta, 4), stride=(4, 1)))
        head, t, slot = head_group, tidx, 0  # the row, this thread's index in it, the row's shared memory
        if cutlass.const_expr(p.warp_rows):
            head, t, slot = head_group * p.rows_per_cta + warp, cute.arch.lane_idx(), warp
        if head < cute.size(score_bits, mode=[1]):
            shared = (hist[slot, None], exchange[slot, None, None], found[slot, None])
            self.select_row(score_bits[token, head, None], token_position[token], out, token, head, t, shared)

    @cute.jit
    def select_row(self, row, position, out, token, head, t, shared):
        """Top-k of one (token, index head) row by its row_threads threads, t = 0 .. row_threads - 1."""
        p = self.p
        # Visible blocks [0, visible), forced ones: [0, init_end) and [local_start, visible).
        visible = cutlass.Int32(0)
        if position >= 0:
            visible = cutlass.min(position // p.block_size + 1, cute.size(row))
        local_start = cutlass.max(visible - p.local_blocks, 0)
        init_end = cutlass.min(visible, p.init_blocks)
        forced = visible
        if init_end <= local_start:
            forced = init_end + visible - local_start
        need = p.topk_blocks - forced
        # Candidates keep a block if key > threshold_hi, or if threshold_lo <= key <= threshold_hi among the
        # first `need_equal` of those (a range when the search stopped early, a single key else).
        threshold_lo = cutlass.Int32(INT32_MIN)
        threshold_hi = cutlass.Int32(INT32_MIN)
        need_equal = visible
        if need == 0:
            threshold_lo = cutlass.Int32(INT32_MAX)
            threshold_hi = cutlass.Int32(INT32_MAX)
            need_equal = cutlass.Int32(0)
        if need > 0 and visible - forced > need:
            threshold_lo, threshold_hi, need_equal = self.radix_select(row, need, init_end, local_start, t, shared)
        threshold = (threshold_lo, threshold_hi)

        # Each thread keeps blocks of its contiguous run; a row scan of the counts places them in order.
        run = (visible + p.row_threads - 1) // p.row_threads
        begin = t * run
        end = cutlass.min(begin + run, visible)
        kept = cutlass.Int32(0)
        equal = cutlass.Int32(0)
        for block in range(begin, end):
            keeps, ties = self.classify(row, block, threshold, init_end, local_start)
            kept += keeps
            equal += ties
        kept_before, kept_total, equal_before, equal_total = self.row_scan(kept, equal, t, shared)
        out_slot = kept_before + cutlass.min(equal_before, need_equal)
        equal_seen = equal_before
        for block in range(begin, end):
            keeps, ties = self.classify(row, block, threshold, init_end, local_start)
            if ties != 0:
                if equal_seen < need_equal:
                    keeps = 1
                equal_seen += 1
            if keeps != 0:
                out[token, head, out_slot] = block
                out_slot += 1
        for empty in range(kept_total + cutlass.min(equal_total, need_equal) + t, p.topk_blocks, p.row_threads):
            out[token, head, empty] = -1

    @cute.jit
    def classify(self, row, block, threshold, init_end, local_start):
        """(1 if the block is kept outright: forced or above the threshold range, 1 if it is in the range)."""
        threshold_lo, threshold_hi = threshold
        keeps = cutlass.Int32(1)
        ties = cutlass.Int32(0)
        if block >= init_end and block < local_start:
            key = self.order_key(row[block])
            keeps = 0
            if key > threshold_hi:
                keeps = 1
            if key >= threshold_lo and key <= threshold_hi:
                ties = 1
        return keeps, ties

    @cute.jit
    def order_key(self, bits: cutlass.Int32) -> cutlass.Int32:
        """The float's order as a signed int: negative floats have their magnitude bits flipped, then + 1 so
        that -0.0 (bits INT32_MIN) is 0 as +0.0 is (no overflow: the largest result is 0)."""
        key = bits
        if bits < 0:
            key = (bits ^ INT32_MAX) + 1
        return key

    @cute.jit
    def radix_select(self, row, need, init_end, local_start, t, shared):
        """(the lowest and highest key of the range the need-th largest candidate key lies in, how many
        candidates in it are kept): one byte per pass, until a bin holds exactly the candidates still wanted.

        Keys are compared as unsigned bytes: key ^ INT32_MIN orders the signed keys as unsigned ints."""
        p = self.p
        hist, _, found = shared
        prefix = cutlass.Int32(0)  # the bytes found so far, in unsigned-key form
        range_lo = cutlass.Int32(0)
        range_hi = cutlass.Int32(0)
        # The same on every thread of the row (it reads `found` after a row barrier), so the barriers inside
        # `if done == 0` are not divergent: a CTA barrier only where a CTA holds one row (row_sync).
        done = cutlass.Int32(0)
        rounds = (local_start - init_end + p.row_threads - 1) // p.row_threads
        for byte in cutlass.range_constexpr(4):
            shift = 24 - 8 * byte
            mask = _int32((0xFFFFFFFF << (32 - 8 * byte)) & 0xFFFFFFFF)  # the bytes above this one
            if done == 0:
                for b in cutlass.range_constexpr(0, BINS, p.row_threads):
                    if b + t < BINS:
                        hist[b + t] = 0
                self.row_sync()
                for r in range(rounds):  # the same count on every thread of the row: match_any needs the warp
                    block = init_end + r * p.row_threads + t
                    digit = cutlass.Int32(-1)
                    if block < local_start:
                        unsigned_key = self.order_key(row[block]) ^ INT32_MIN
                        if (unsigned_key & mask) == prefix:
                            digit = (unsigned_key >> shift) & (BINS - 1)
                    peers = self.match_any(digit)
                    lane_below = (cutlass.Int32(1) << cute.arch.lane_idx()) - 1
                    if digit >= 0 and (peers & lane_below) == 0:  # the lowest lane of those holding this byte
                        cute.arch.atomic_add(hist.iterator + digit, cute.arch.popc(peers), scope="cta")
                self.row_sync()
                # Bins from the top: thread t holds bins BINS-1 - t*bins_per_thread, ... down.
                count = cutlass.Int32(0)
                for j in cutlass.range_constexpr(p.bins_per_thread):
                    if t * p.bins_per_thread + j < BINS:
                        count += hist[BINS - 1 - t * p.bins_per_thread - j]
                above, _, _, _ = self.row_scan(count, cutlass.Int32(0), t, shared)
                for j in cutlass.range_constexpr(p.bins_per_thread):
                    if t * p.bins_per_thread + j < BINS:
                        bin_ = BINS - 1 - t * p.bins_per_thread - j
                        in_bin = hist[bin_]
                        if above < need and above + in_bin >= need:
                            found[0] = bin_
                            found[1] = above
                            found[2] = in_bin
                        above += in_bin
                self.row_sync()
                prefix = prefix | (found[0] << shift)
                need = need - found[1]
                if found[2] == need:
                    done = cutlass.Int32(1)
                range_lo = prefix
                range_hi = prefix | ((1 << shift) - 1)  # the bytes below this one: any
        return range_lo ^ INT32_MIN, range_hi ^ INT32_MIN, need

    @cute.jit
    def match_any(self, value: cutlass.Int32) -> cutlass.Int32:
        """The lanes of the warp holding the same value (match.any.sync)."""
        return cute.arch.inline_ptx(
            "match.any.sync.b32 {$w0}, {$r0}, 0xffffffff;", write_only_types=[cutlass.Int32], read_only_args=[value]
        )

    @cute.jit
    def row_sync(self):
        if cutlass.const_expr(self.p.warp_rows):
            cute.arch.sync_warp()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def row_scan(self, a, b, t, shared):
        """Exclusive prefix sums over the row's threads of two counts, and their totals:
        (a before t, a total, b before t, b total)."""
        _, exchange, _ = shared
        lane = cute.arch.lane_idx()
        a_incl, b_incl = a, b
        for step in cutlass.range_constexpr(5):
            a_up = cute.arch.shuffle_sync_up(a_incl, 1 << step)
            b_up = cute.arch.shuffle_sync_up(b_incl, 1 << step)
            if lane >= 1 << step:
                a_incl += a_up
                b_incl += b_up
        a_before, b_before = a_incl - a, b_incl - b
        a_total = cute.arch.shuffle_sync(a_incl, WARP - 1)
        b_total = cute.arch.shuffle_sync(b_incl, WARP - 1)
        if cutlass.const_expr(not self.p.warp_rows):
            warp = t // WARP
            self.row_sync()  # every warp has read the previous scan's totals
            if lane == WARP - 1:
                exchange[0, warp] = a_incl
                exchange[1, warp] = b_incl
            self.row_sync()
            a_total = cutlass.Int32(0)
            b_total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(self.p.row_warps):
                if w < warp:
                    a_before += exchange[0, w]
                    b_before += exchange[1, w]
                a_total += exchange[0, w]
                b_total += exchange[1, w]
        return a_before, a_total, b_before, b_total


def topk_blocks(
    scores: torch.Tensor,
    positions: torch.Tensor,
    shape: MSAShape,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    phase: Phase = "decode",
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.topk_blocks, for fp32 scores and int32 positions (as
    PagedBatch.positions) on Hopper; ties go to the lower block number. out: [T, Hi, K] int32 to write
    (a slice of a step's selection), else a new tensor. threads: threads per row (TopkBlocksParams), else
    row_threads' choice for the phase and the row length."""
    num_tokens, num_heads, max_blocks = scores.shape
    result = out if out is not None else scores.new_empty((num_tokens, num_heads, shape.topk_blocks), dtype=torch.int32)
    if num_tokens:
        bind_topk(positions, max_blocks, shape, phase, threads)(scores, result)
    return result


def bind_topk(
    positions: torch.Tensor, max_blocks: int, shape: MSAShape, phase: Phase = "decode", threads: int | None = None
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """topk_blocks bound to a batch's token positions and row length (what a step's layers share worked out
    once): (scores [T, Hi, max_blocks], out [T, Hi, K] int32) -> None."""
    kernel = _kernel(shape, threads or row_threads(phase, max_blocks))

    def launch(scores: torch.Tensor, out: torch.Tensor) -> None:
        result = contiguous_out(out, out.shape, torch.int32, out.device)
        kernel(scores.contiguous().view(torch.int32), positions, result)
        copy_into(result, out)

    return launch


@functools.cache
def _kernel(shape: MSAShape, row_threads: int) -> "tvm_ffi.Function":
    params = TopkBlocksParams(
        shape.topk_blocks, shape.local_blocks, shape.init_blocks, shape.block_size, row_threads=row_threads
    )
    return compiled_kernel(TopkBlocksKernel, params)
