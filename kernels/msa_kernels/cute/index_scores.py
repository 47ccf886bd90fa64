"""CuTeDSL kernel: causal max-pooled index block scores against the paged bf16 index-key cache.

Computes reference.index_block_scores: out[t, h, b] = max over visible keys j of block b of
index_q[t, h] . index_key[j, h // (Hi / Hki)], -inf for blocks with no visible key.

One CTA (128 threads) per (logical block, query token). Dp / lane_elems neighbouring lanes share a key
row, each loading lane_elems contiguous elements (8: one 16-byte load; 16: two, and half the lanes a row, so
a row's dot takes one shuffle stage fewer per head), so a warp reads whole rows (coalesced); a thread keeps
its lane_elems-wide slice of every index query in registers, the lanes of a row add their partial dots with
shuffles, each thread keeps a running max per head over its rows, and the
CTA reduces the max with warp shuffles and a [warps, Hi] shared-memory exchange. SIMT decode path:
memory bound, each key page is read once per query token (90% of the copy bandwidth at M3's 128K x 32).
index_block_scores launches it (FP8 index-key pages: index_scores_fp8.py), with lane_elems from the shape
(lane_elems_for).
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
from msa_kernels.cute.runtime import block_scores_out, compiled_kernel
from msa_kernels.plan import Workspace
from msa_kernels.shapes import MSAShape, PagedBatch

if TYPE_CHECKING:
    import tvm_ffi

WARP = 32


def lane_elems_for(num_tokens: int) -> int:
    """Key elements a lane loads from a row: 16 for a single query token (latency-bound: one shuffle stage fewer
    per row), else 8: what measured faster for each (results/README.md, twelfth session, "Decode candidates")."""
    return 16 if num_tokens == 1 else 8


@dataclass(frozen=True)
class IndexScoreParams:
    num_index_heads: int  # Hi
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    block_size: int = 128  # B == threads per CTA
    lane_elems: int = 8  # bf16 elements of a key row one lane loads (a multiple of 8: 16-byte loads)

    @property
    def warps(self) -> int:
        return self.block_size // WARP

    @property
    def lanes_per_row(self) -> int:
        """Threads sharing one key row, each loading lane_elems contiguous elements."""
        return self.index_head_dim // self.lane_elems

    @property
    def rows_per_step(self) -> int:
        return self.block_size // self.lanes_per_row


class IndexScoreKernel:
    def __init__(self, params: IndexScoreParams):
        assert params.num_index_heads % params.num_index_key_heads == 0
        assert self.can_implement(torch.bfloat16, torch.bfloat16, params.index_head_dim, params.block_size)
        assert params.lane_elems % 8 == 0 and params.index_head_dim % params.lane_elems == 0
        self.p = params

    @classmethod
    def can_implement(
        cls, dtype: torch.dtype, index_key_dtype: torch.dtype, index_head_dim: int, block_size: int
    ) -> bool:
        """bf16 index queries and index keys; 128-token blocks; a
        key row in whole 16-byte loads of at most one warp."""
        if dtype != torch.bfloat16 or index_key_dtype != torch.bfloat16:
            return False
        return block_size == 128 and index_head_dim % 8 == 0 and 32 % (index_head_dim // 8) == 0

    @staticmethod
    def fake_arguments(params: IndexScoreParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        return (
            row_major(bf16, 3, align=16),  # index_q
            row_major(bf16, 4, align=16),  # index_keys
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
        index_keys: cute.Tensor,  # [pages, B, Hki, Dp] bf16
        block_table: cute.Tensor,  # [R, max_blocks] int32
        token_request: cute.Tensor,  # [T] int32
        token_position: cute.Tensor,  # [T] int32
        out: cute.Tensor,  # [T, Hi, max_blocks] fp32
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(index_q, mode=[0])
        max_blocks = cute.size(block_table, mode=[1])
        self.kernel(index_q, index_keys, block_table, token_request, token_position, out).launch(
            grid=[num_tokens, max_blocks, 1], block=[self.p.block_size, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        index_q: cute.Tensor,
        index_keys: cute.Tensor,
        block_table: cute.Tensor,
        token_request: cute.Tensor,
        token_position: cute.Tensor,
        out: cute.Tensor,
    ):
        wait_for_previous_kernel()  # before any global memory access (pdl.py)
        p = self.p
        heads_per_key = p.num_index_heads // p.num_index_key_heads
        tidx, _, _ = cute.arch.thread_idx()
        token, block, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        partial_max = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((p.warps, p.num_index_heads), stride=(p.num_index_heads, 1))
        )

        position = token_position[token]
        neg_inf = cutlass.Float32(-cutlass.Float32.inf)
        col = tidx % p.lanes_per_row
        best = cute.make_rmem_tensor((p.num_index_heads,), cutlass.Float32)
        best.fill(neg_inf)
        if block * p.block_size <= position:
            page = block_table[token_request[token], block]
            for kh in cutlass.range_constexpr(p.num_index_key_heads):
                queries = []
                for g in cutlass.range_constexpr(heads_per_key):
                    q_chunk = cute.zipped_divide(index_q[token, kh * heads_per_key + g, None], (p.lane_elems,))[
                        (None, col)
                    ]
                    q_frag = cute.make_fragment_like(q_chunk)
                    cute.autovec_copy(q_chunk, q_frag)
                    queries.append(q_frag.load().to(cutlass.Float32))
                for step in cutlass.range_constexpr(p.block_size // p.rows_per_step):
                    row = tidx // p.lanes_per_row + step * p.rows_per_step
                    k_chunk = cute.zipped_divide(index_keys[page, row, kh, None], (p.lane_elems,))[(None, col)]
                    k_frag = cute.make_fragment_like(k_chunk)
                    cute.autovec_copy(k_chunk, k_frag)
                    k = k_frag.load().to(cutlass.Float32)
                    for g in cutlass.range_constexpr(heads_per_key):
                        h = kh * heads_per_key + g
                        partial = (k * queries[g]).reduce(
                            cute.ReductionOp.ADD, cutlass.Float32(0.0), reduction_profile=0
                        )
                        score = cute.arch.warp_reduction_sum(partial, threads_in_group=p.lanes_per_row)
                        if block * p.block_size + row <= position:
                            best[h] = cute.arch.fmax(best[h], score)
            for h in cutlass.range_constexpr(p.num_index_heads):
                score = cute.arch.warp_reduction_max(best[h])
                if lane == 0:
                    partial_max[warp, h] = score
            cute.arch.sync_threads()
            if tidx < p.num_index_heads:
                block_max = partial_max[0, tidx]
                for w in cutlass.range_constexpr(1, p.warps):
                    block_max = cute.arch.fmax(block_max, partial_max[w, tidx])
                out[token, tidx, block] = block_max
        else:
            if tidx < p.num_index_heads:
                out[token, tidx, block] = neg_inf


def index_block_scores(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    batch: PagedBatch,
    shape: MSAShape,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Same contract as msa_kernels.reference.index_block_scores, for bf16 index queries and a bf16 index-key
    cache on Hopper: every token on its own. workspace: into its block scores (runtime.block_scores_out)."""
    return bind_block_scores(batch, shape, workspace)(index_q, index_key_cache)


def bind_block_scores(
    batch: PagedBatch, shape: MSAShape, workspace: Workspace | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """index_block_scores bound to a batch (what a step's layers share worked out once): (index_q, index_key_cache)
    -> the block scores."""
    out = block_scores_out(batch, shape.num_index_heads, workspace)
    kernel = _kernel(shape, lane_elems_for(batch.num_tokens))
    batch_inputs = (batch.block_table, batch.token_requests, batch.positions)

    def launch(index_q: torch.Tensor, index_key_cache: torch.Tensor) -> torch.Tensor:
        kernel(index_q.contiguous(), index_key_cache, *batch_inputs, out)
        return out

    return launch


@functools.cache
def _kernel(shape: MSAShape, lane_elems: int) -> "tvm_ffi.Function":
    params = IndexScoreParams(
        shape.num_index_heads, shape.num_index_key_heads, shape.index_head_dim, shape.block_size, lane_elems
    )
    return compiled_kernel(IndexScoreKernel, params)
