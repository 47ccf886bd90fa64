"""CuTeDSL kernel: merge partial attention outputs into the final output: sparse_attn.py's split-K partials
(fp32) and sparse_attn_by_block.py's partials of one block each (bf16, a selection slot each).

out[t, g] = sum_s w_s o_s[t, g] / sum_s w_s with w_s = exp(lse_s[t, g] - max_s lse_s[t, g]);
partials that saw no key have lse = -inf and weight 0, whatever they hold (sparse_attn_by_block.py leaves
the partials of unselected slots unwritten). One CTA per (token, query head), one thread per output element
of the head dim. The partial count is a compile-time constant (a kernel per count: a few), so both loops
unroll fully and every load of a thread is in flight at once: a merge costs two L2 round trips (the
log-sum-exps, then nothing but the partials, whose loads do not wait on them) where a loop over a run-time
count waited once per group of loads. combine_splits launches it.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.pdl import wait_for_previous_kernel
from msa_kernels.cute.runtime import compiled_kernel

if TYPE_CHECKING:
    import tvm_ffi


@dataclass(frozen=True)
class CombineParams:
    num_q_heads: int  # Hq
    head_dim: int  # D: threads per CTA
    splits: int  # S: the partials each output merges
    bf16_partials: bool = False  # partials in bf16 (sparse_attn_by_block.py's), else fp32
    gated: bool = False  # leave the (token, index head) rows that `handled` marks (the prefill kernel wrote them)


class CombineKernel:
    def __init__(self, params: CombineParams):
        self.p = params

    @staticmethod
    def fake_arguments(params: CombineParams) -> tuple:
        return (
            row_major(cutlass.BFloat16 if params.bf16_partials else cutlass.Float32, 4, align=16),  # partial_out
            row_major(cutlass.Float32, 3),  # partial_lse
            row_major(cutlass.BFloat16, 3, align=16),  # out
            row_major(cutlass.Int32, 2) if params.gated else None,  # handled
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        partial_out: cute.Tensor,  # [S, T, Hq, D] fp32 or bf16
        partial_lse: cute.Tensor,  # [S, T, Hq] fp32
        out: cute.Tensor,  # [T, Hq, D] bf16
        handled: cute.Tensor | None,  # [T, Hi] int32, gated only: nonzero rows are already written
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(out, mode=[0])
        self.kernel(partial_out, partial_lse, out, handled).launch(
            grid=[num_tokens, self.p.num_q_heads, 1], block=[self.p.head_dim, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, handled: cute.Tensor | None):
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        d, _, _ = cute.arch.thread_idx()
        token, head, _ = cute.arch.block_idx()
        written = cutlass.Int32(0)
        if cutlass.const_expr(self.p.gated):
            written = handled[token, head * cute.size(handled, mode=[1]) // self.p.num_q_heads]
        if written == 0:
            self.merge(partial_out, partial_lse, out, token, head, d)

    @cute.jit
    def merge(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, token, head, d):
        """out[token, head, d] from the partials."""
        lse = cute.make_rmem_tensor((self.p.splits,), cutlass.Float32)
        for s in cutlass.range(self.p.splits, unroll_full=True):
            lse[s] = partial_lse[s, token, head]
        lse_max = -cutlass.Float32.inf
        for s in cutlass.range(self.p.splits, unroll_full=True):
            lse_max = cute.arch.fmax(lse_max, lse[s])
        if lse_max == -cutlass.Float32.inf:
            lse_max = cutlass.Float32(0.0)
        total = cutlass.Float32(0.0)
        acc = cutlass.Float32(0.0)
        for s in cutlass.range(self.p.splits, unroll_full=True):  # an empty split (lse -inf) weighs 0
            weight = cute.math.exp(lse[s] - lse_max, fastmath=True)
            value = partial_out[s, token, head, d].to(cutlass.Float32)
            total += weight
            if weight > 0.0:  # 0 x whatever an unwritten partial holds (NaN) stays out
                acc += weight * value
        result = cutlass.Float32(0.0)  # a token that selected nothing (CUDA-graph padding) gets zeros
        if total > 0.0:
            result = acc / total
        out[token, head, d] = result.to(out.element_type)


def combine_splits(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, handled: torch.Tensor | None = None
) -> None:
    """Merge partials [S, T, Hq, D] fp32 or bf16 with their log-sum-exps [S, T, Hq] into out [T, Hq, D] bf16
    (contiguous); with `handled` ([T, Hi] int32) only the rows of the (token, index head)s it leaves at 0."""
    splits, _, num_q_heads, head_dim = partial_out.shape
    bf16 = partial_out.dtype == torch.bfloat16
    _kernel(num_q_heads, head_dim, splits, bf16, handled is not None)(partial_out, partial_lse, out, handled)


@functools.cache
def _kernel(num_q_heads: int, head_dim: int, splits: int, bf16_partials: bool, gated: bool) -> "tvm_ffi.Function":
    return compiled_kernel(CombineKernel, CombineParams(num_q_heads, head_dim, splits, bf16_partials, gated))
