"""CuTeDSL kernel: merge sparse_attn.py's split-K partial outputs (fp32) into the final output.

out[t, g] = sum_s w_s o_s[t, g] / sum_s w_s with w_s = exp(lse_s[t, g] - max_s lse_s[t, g]);
partials that saw no key have lse = -inf and weight 0, whatever they hold. One CTA per (token, query head), one
thread per output element
of the head dim. The partial count is a compile-time constant (a kernel per count: a few), so both loops
unroll fully and every load of a thread is in flight at once: a merge costs two L2 round trips (the
log-sum-exps, then nothing but the partials, whose loads do not wait on them) where a loop over a run-time
count waited once per group of loads. combine_splits launches it.
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
from msa_kernels.cute.runtime import compiled_kernel

if TYPE_CHECKING:
    import tvm_ffi


@dataclass(frozen=True)
class CombineParams:
    num_q_heads: int  # Hq
    head_dim: int  # D: threads per CTA
    splits: int  # S: the partials each output merges


class CombineKernel:
    def __init__(self, params: CombineParams):
        self.p = params

    @staticmethod
    def fake_arguments(params: CombineParams) -> tuple:
        return (
            row_major(cutlass.Float32, 4, align=16),  # partial_out
            row_major(cutlass.Float32, 3),  # partial_lse
            row_major(cutlass.BFloat16, 3, align=16),  # out
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        partial_out: cute.Tensor,  # [S, T, Hq, D] fp32
        partial_lse: cute.Tensor,  # [S, T, Hq] fp32
        out: cute.Tensor,  # [T, Hq, D] bf16
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(out, mode=[0])
        self.kernel(partial_out, partial_lse, out).launch(
            grid=[num_tokens, self.p.num_q_heads, 1], block=[self.p.head_dim, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor):
        """out[token, head, d] from the partials."""
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        d, _, _ = cute.arch.thread_idx()
        token, head, _ = cute.arch.block_idx()
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


def combine_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge partials [S, T, Hq, D] fp32 with their log-sum-exps [S, T, Hq] into out [T, Hq, D] bf16 (contiguous)."""
    bind_combine(partial_out, partial_lse)(out)


def bind_combine(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """combine_splits bound to its partials (a step part's, which its layers share): out -> None."""
    splits, _, num_q_heads, head_dim = partial_out.shape
    kernel = _kernel(num_q_heads, head_dim, splits)
    return lambda out: kernel(partial_out, partial_lse, out)


@functools.cache
def _kernel(num_q_heads: int, head_dim: int, splits: int) -> "tvm_ffi.Function":
    return compiled_kernel(CombineKernel, CombineParams(num_q_heads, head_dim, splits))
