"""CuTeDSL kernel: what a step's selections add to the served metrics' totals, in one launch without a host sync.

Computes msa_kernels.selection_stats.add_selection_stats (the PyTorch path runs ~30 small kernels a step for it).
Each thread counts one selection (a query token's K blocks for one index head) in float64, as the reference does
(read_tokens / context_tokens rounded once); a warp sums its threads' values field by field with shuffles, and its
first lane adds each nonzero sum, times the step's MSA layers, to the totals with a float64 atomic. Integer counts
are exact; the read-fraction sum differs from the reference's by the order of its additions.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.selection_stats import READ_FRACTION_BUCKETS, SELECTION_COUNTERS, SELECTION_FIELDS

if TYPE_CHECKING:
    import tvm_ffi

THREADS = 128
FRACTION_SUM = len(SELECTION_COUNTERS)  # the totals' read-fraction fields: the sum, then a count per bucket
FIRST_BUCKET = FRACTION_SUM + 1


@dataclass(frozen=True)
class SelectionStatsParams:
    topk_blocks: int  # K
    block_size: int


class SelectionStatsKernel:
    def __init__(self, params: SelectionStatsParams):
        self.p = params

    @staticmethod
    def fake_arguments(params: SelectionStatsParams) -> tuple:
        return (
            row_major(cutlass.Int32, 3),  # selected [T, Hi, K]
            row_major(cutlass.Int32, 1),  # positions [>= T]
            row_major(cutlass.Float64, 1),  # totals [SELECTION_FIELDS]
            cutlass.Int32(0),  # decode_tokens
            cutlass.Float64(1.0),  # layers
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        selected: cute.Tensor,
        positions: cute.Tensor,
        totals: cute.Tensor,
        decode_tokens: cutlass.Int32,
        layers: cutlass.Float64,
        stream: cuda.CUstream,
    ):
        num_selections = cute.size(selected, mode=[0]) * cute.size(selected, mode=[1])
        self.kernel(selected, positions, totals, decode_tokens, layers, num_selections).launch(
            grid=[(num_selections + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        selected: cute.Tensor,
        positions: cute.Tensor,
        totals: cute.Tensor,
        decode_tokens: cutlass.Int32,
        layers: cutlass.Float64,
        num_selections: cutlass.Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        selection = cta * THREADS + tidx
        values = cute.make_rmem_tensor((len(SELECTION_FIELDS),), cutlass.Float64)
        values.fill(0.0)
        if selection < num_selections:
            token = selection // cute.size(selected, mode=[1])
            head = selection % cute.size(selected, mode=[1])
            position = positions[token]
            if position >= 0:  # a CUDA graph's padding tokens sit at -1 and count nothing
                blocks = cutlass.Int32(0)
                for k in cutlass.range_constexpr(p.topk_blocks):
                    if selected[token, head, k] >= 0:
                        blocks += 1
                context = position + 1
                read = blocks * p.block_size - (p.block_size - 1 - position % p.block_size)
                fraction = cutlass.Float64(read) / cutlass.Float64(context)
                values[0] = 1.0
                if token < decode_tokens:
                    values[1] = 1.0
                values[2] = cutlass.Float64(blocks)
                values[3] = cutlass.Float64(context)
                values[4] = cutlass.Float64(read)
                values[FRACTION_SUM] = fraction
                bucket = cutlass.Int32(0)  # the first bound the fraction does not exceed (torch.bucketize)
                for b in cutlass.range_constexpr(len(READ_FRACTION_BUCKETS)):
                    if fraction > cutlass.Float64(READ_FRACTION_BUCKETS[b]):
                        bucket += 1
                for b in cutlass.range_constexpr(len(READ_FRACTION_BUCKETS) + 1):
                    if bucket == b:
                        values[FIRST_BUCKET + b] = 1.0
        lane = cute.arch.lane_idx()
        for field in cutlass.range_constexpr(len(SELECTION_FIELDS)):
            total = cute.arch.warp_reduction_sum(values[field])
            if lane == 0 and total != 0.0:
                cute.arch.atomic_add(totals.iterator + field, total * layers)


def add_selection_stats(
    totals: torch.Tensor,
    selected: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    decode_tokens: int,
    layers: int,
) -> None:
    """Same contract as msa_kernels.selection_stats.add_selection_stats, for a contiguous int32 selection [T, Hi, K]
    and int32 positions on the GPU."""
    num_tokens, _, topk_blocks = selected.shape
    if num_tokens == 0:
        return
    _kernel(topk_blocks, block_size)(selected, positions, totals, decode_tokens, float(layers))


@functools.cache
def _kernel(topk_blocks: int, block_size: int) -> "tvm_ffi.Function":
    return compiled_kernel(SelectionStatsKernel, SelectionStatsParams(topk_blocks, block_size))
