"""The warpgroup pieces of the prefill attention (sparse_attn_prefill.py: a tile of tokens over the union of their
blocks): a warpgroup's 64 MMA rows (tokens x the query heads of one index head), S = Q K^T and O += P V on
warpgroup MMAs, one TMA descriptor over the whole paged K/V cache and the page tiles it copies into shared memory
(V read transposed), the 16-byte copy of query rows, and zeroing a page's V rows past the request.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from msa_kernels.cute.warp_mma import acc_as_a_operand

ROWS = 64  # the warpgroup MMA's M: a warpgroup's tokens x query heads per index head
WARPGROUP = 128  # threads
LOG2_E = 1.4426950408889634


def smem_atom():
    """128-byte swizzled K-major bf16 tiles (8 x 64 atoms): what TMA writes and wgmma reads."""
    return warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cutlass.BFloat16)


def attention_mmas(block_size: int, head_dim: int) -> tuple[cute.TiledMma, cute.TiledMma]:
    """(S = Q K^T: both operands K-major in shared memory; O += P V: P from registers, V^T d-contiguous), ROWS
    rows each."""
    bf16 = cutlass.BFloat16
    mma_qk = sm90_utils.make_trivial_tiled_mma(
        bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, (1, 1, 1), (ROWS, block_size)
    )
    mma_pv = sm90_utils.make_trivial_tiled_mma(
        bf16,
        bf16,
        OperandMajorMode.K,
        OperandMajorMode.MN,
        cutlass.Float32,
        (1, 1, 1),
        (ROWS, head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )
    return mma_qk, mma_pv


def kv_cache_tma(kv_cache: cute.Tensor, kv_layout: cute.ComposedLayout, block_size: int, head_dim: int):
    """(TMA atom, TMA tensor) over the whole K/V cache [pages, 2, B, Hkv, D], modes ordered (key, d, kv head,
    K|V, page): a (B, D) box is one page's K or V of one head; head, K|V and page are picked in the kernel."""
    kv_view = cute.make_tensor(kv_cache.iterator, cute.select(kv_cache.layout, mode=[2, 4, 3, 1, 0]))
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), kv_view, cute.select(kv_layout, mode=[0, 1]), (block_size, head_dim)
    )


def page_tiles(tma_atom: cute.CopyAtom, g_kv: cute.Tensor, s_k: cute.Tensor, s_v: cute.Tensor):
    """(K stages, V stages, global pages) partitioned for the TMA copy of one (B, D) page tile: g_kv is the cache's
    tiles with the page's modes left open (kv_cache_tma's tensor, local-tiled), s_k / s_v the shared (B, D, stages)
    rings; a load copies the global pages' [None, ..., page] into a ring's [None, stage]."""
    t_k, t_kv = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(s_k, 0, 2), cute.group_modes(g_kv, 0, 2)
    )
    t_v, _ = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(s_v, 0, 2), cute.group_modes(g_kv, 0, 2)
    )
    return t_k, t_v, t_kv


def transposed_pages(s_v: cute.Tensor, block_size: int, head_dim: int, stages: int) -> cute.Tensor:
    """The shared (B, D, stages) V ring read as V^T (D, B, stages): P V's B operand."""
    return cute.composition(s_v, cute.make_ordered_layout((head_dim, block_size, stages), order=(1, 0, 2)))


def query_row_copy(head_dim: int) -> cute.TiledCopy:
    """cp.async of 16-byte chunks by a warpgroup, WARPGROUP / (D / 8) whole rows a step."""
    chunks_per_row = head_dim // 8
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.BFloat16, num_bits_per_copy=128),
        cute.make_layout((WARPGROUP // chunks_per_row, chunks_per_row), stride=(chunks_per_row, 1)),
        cute.make_layout((1, 8)),
    )


@cute.jit
def zero_rows_past(thr_copy, page: cute.Tensor, page_coords: cute.Tensor, valid_rows):
    """Zero the rows from valid_rows on of one page's V tile (the stale slots past a request: P is 0 there, but
    0 x NaN is not), this thread's chunks of query_row_copy, then fence them for the MMAs' async proxy."""
    rows = thr_copy.partition_D(page)
    for i in cutlass.range_constexpr(cute.size(rows, mode=[1])):
        if page_coords[0, i, 0][0] >= valid_rows:
            rows[None, i, None].fill(0)
    cute.arch.fence_view_async_shared()


@cute.jit
def probabilities(thr_pv, acc_s: cute.Tensor, rows: cutlass.Constexpr, keys: cutlass.Constexpr) -> cute.Tensor:
    """The probabilities in S's accumulator (after the softmax) as P V's bf16 register A operand."""
    t_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((rows, keys)), cutlass.BFloat16)
    t_p.store(cute.make_tensor(acc_s.iterator, acc_as_a_operand(acc_s.layout)).load().to(cutlass.BFloat16))
    return t_p


@cute.jit
def gemm_pv(mma_pv: cute.TiledMma, acc_o: cute.Tensor, t_p: cute.Tensor, t_vt: cute.Tensor):
    """acc_o += P V over one page's keys (t_vt: the V^T fragment of that page); returns once the MMAs are done."""
    warpgroup.fence()
    pv = cute.make_mma_atom(mma_pv.op)
    pv.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
        cute.gemm(pv, acc_o, t_p[None, None, k], t_vt[None, None, k], acc_o)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
