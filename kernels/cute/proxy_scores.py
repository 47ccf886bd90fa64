"""CuTeDSL kernel: causal max-pooled proxy block scores against the paged proxy-key cache.

Computes reference.proxy_block_scores: out[t, h, b] = max over visible keys j of block b of
index_q[t, h] . proxy_key[j, h // (Hi / Hki)], -inf for blocks with no visible key.

One CTA per (logical block, query token), one thread per key of the 128-token block: each thread
loads its key row once (vectorised), dots it with every index head's query, and the CTA reduces the
max with warp shuffles and a [warps, Hi] shared-memory exchange. This is the SIMT decode path
(memory bound: each key page is read once per query token).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

WARP = 32


@dataclass(frozen=True)
class ProxyScoreParams:
    num_index_heads: int  # Hi
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    block_size: int = 128  # B == threads per CTA

    @property
    def warps(self) -> int:
        return self.block_size // WARP


class ProxyScoreKernel:
    def __init__(self, params: ProxyScoreParams):
        assert params.block_size % WARP == 0 and params.num_index_heads % params.num_index_key_heads == 0
        self.p = params

    @cute.jit
    def __call__(
        self,
        index_q: cute.Tensor,  # [T, Hi, Dp] bf16
        proxy_cache: cute.Tensor,  # [pages, B, Hki, Dp] bf16
        block_table: cute.Tensor,  # [R, max_blocks] int32
        token_request: cute.Tensor,  # [T] int32
        token_position: cute.Tensor,  # [T] int32
        out: cute.Tensor,  # [T * Hi * max_blocks] fp32, row-major [T, Hi, max_blocks]
    ):
        num_tokens = cute.size(index_q, mode=[0])
        max_blocks = cute.size(block_table, mode=[1])
        self.kernel(index_q, proxy_cache, block_table, token_request, token_position, out).launch(
            grid=[max_blocks, num_tokens, 1], block=[self.p.block_size, 1, 1]
        )

    @cute.kernel
    def kernel(
        self,
        index_q: cute.Tensor,
        proxy_cache: cute.Tensor,
        block_table: cute.Tensor,
        token_request: cute.Tensor,
        token_position: cute.Tensor,
        out: cute.Tensor,
    ):
        p = self.p
        max_blocks = cute.size(block_table, mode=[1])
        heads_per_key = p.num_index_heads // p.num_index_key_heads
        tidx, _, _ = cute.arch.thread_idx()
        block, token, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()

        smem = cutlass.utils.SmemAllocator()
        partial_max = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((p.warps, p.num_index_heads), stride=(p.num_index_heads, 1))
        )

        position = token_position[token]
        neg_inf = cutlass.Float32(-cutlass.Float32.inf)
        if block * p.block_size <= position:
            page = block_table[token_request[token], block]
            visible = block * p.block_size + tidx <= position
            for kh in cutlass.range_constexpr(p.num_index_key_heads):
                key = cute.make_fragment_like(proxy_cache[page, tidx, kh, None])
                cute.autovec_copy(proxy_cache[page, tidx, kh, None], key)
                k = key.load().to(cutlass.Float32)
                for g in cutlass.range_constexpr(heads_per_key):
                    h = kh * heads_per_key + g
                    query = cute.make_fragment_like(index_q[token, h, None])
                    cute.autovec_copy(index_q[token, h, None], query)
                    score = (k * query.load().to(cutlass.Float32)).reduce(
                        cute.ReductionOp.ADD, cutlass.Float32(0.0), reduction_profile=0
                    )
                    if not visible:
                        score = neg_inf
                    score = cute.arch.warp_reduction_max(score)
                    if lane == 0:
                        partial_max[warp, h] = score
            cute.arch.sync_threads()
            if tidx < p.num_index_heads:
                best = partial_max[0, tidx]
                for w in cutlass.range_constexpr(1, p.warps):
                    best = cute.arch.fmax(best, partial_max[w, tidx])
                out[(token * p.num_index_heads + tidx) * max_blocks + block] = best
        else:
            if tidx < p.num_index_heads:
                out[(token * p.num_index_heads + tidx) * max_blocks + block] = neg_inf


def fake_arguments(params: ProxyScoreParams):
    """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
    t, pages, r, nb, n_out = (cute.sym_int() for _ in range(5))
    hi, hki, dp, b = params.num_index_heads, params.num_index_key_heads, params.index_head_dim, params.block_size
    row_major = lambda n: tuple(range(n - 1, -1, -1))  # noqa: E731
    bf16, i32 = cutlass.BFloat16, cutlass.Int32
    return (
        make_fake_compact_tensor(bf16, (t, hi, dp), stride_order=row_major(3), assumed_align=16),
        make_fake_compact_tensor(bf16, (pages, b, hki, dp), stride_order=row_major(4), assumed_align=16),
        make_fake_compact_tensor(i32, (r, nb), stride_order=row_major(2)),
        make_fake_compact_tensor(i32, (t,)),
        make_fake_compact_tensor(i32, (t,)),
        make_fake_compact_tensor(cutlass.Float32, (n_out,)),
    )


def compile_proxy_scores(params: ProxyScoreParams):
    return cute.compile(ProxyScoreKernel(params), *fake_arguments(params))
