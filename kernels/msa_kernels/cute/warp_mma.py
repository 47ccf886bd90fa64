"""Register-fragment helpers for tensor-core MMAs in CuTeDSL kernels: mma.sync m16n8k16 fragments
(rows_cols, as_a_operand), warpgroup MMAs (warpgroup_gemm_nt; accumulators: acc_rows_cols,
acc_as_a_operand) and tile copies; the row helpers (quad_reduce, online_softmax_row) serve both kinds of
accumulator, whose rows are spread over the 4 lanes of a quad the same way."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator fragment ((2, 2), M, N) as this thread's (rows, cols)."""
    layout = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((layout.shape[0][1], layout.shape[1]), (layout.shape[0][0], layout.shape[2])),
        stride=((layout.stride[0][1], layout.stride[1]), (layout.stride[0][0], layout.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def as_a_operand(layout: cute.Layout) -> cute.Layout:
    """Accumulator layout (4, M, N) as the A operand ((4, 2), M, N / 2) of the next MMA."""
    d = cute.logical_divide(layout, (None, None, 2))
    return cute.make_layout(
        ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """A warpgroup accumulator ((2, 2, N/8), 1, 1) (or its coordinate partition) as (rows, cols).

    Thread l of warp w holds rows 16 w + l // 4 + 8 h and columns 8 j + 2 (l % 4) + c: as with
    mma.sync, each row is spread over the 4 lanes of a quad.
    """
    s, d = t.layout.shape, cute.make_layout(t.layout.shape).stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])), stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def acc_as_a_operand(layout: cute.Layout) -> cute.Layout:
    """The accumulator layout of S as the register A operand ((2, 2, 2), 1, (N/16, 1)) of the next
    wgmma: a 16-key slice of A is two adjacent 8-column blocks of the accumulator."""
    t = cute.logical_divide(layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((t.shape[0][0], t.shape[0][1], t.shape[0][2][0]), t.shape[1], (t.shape[0][2][1], t.shape[2])),
        stride=((t.stride[0][0], t.stride[0][1], t.stride[0][2][0]), t.stride[1], (t.stride[0][2][1], t.stride[2])),
    )


@cute.jit
def warpgroup_gemm_nt(mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, stage):
    """acc = A B^T on warpgroup MMAs, the fragments of A (MMA, M, K) and of B's buffer `stage`
    (MMA, N, K, stages) in shared memory; returns once the MMAs are done, so the caller may read acc
    and release that buffer."""
    atom = cute.make_mma_atom(mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k, stage], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


def quad_reduce(value, op):
    """Reduce over the 4 lanes that hold one accumulator row."""
    for offset in (2, 1):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset, mask=-1, mask_and_clamp=31))
    return value


@cute.jit
def online_softmax_row(
    scores: cute.Tensor,
    out: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    r: cutlass.Constexpr,
    scale_log2: cutlass.Float32,
):
    """Online softmax step for accumulator row r of (rows, cols) views (a row spread over a quad):
    the row's scores (masked keys at -inf) become probabilities against the new running max, in
    place, and its output accumulator and running sum are rescaled to that max. A row that has seen
    no visible key keeps max -inf and sum 0."""
    f32 = cutlass.Float32
    values = scores[r, None].load()
    tile_max = quad_reduce(values.reduce(cute.ReductionOp.MAX, -f32.inf, 0), cute.arch.fmax)
    new_max = cute.arch.fmax(tile_max, row_max[r])
    safe_max = 0.0 if new_max == -f32.inf else new_max
    probs = cute.math.exp2(values * scale_log2 - safe_max * scale_log2, fastmath=True)
    rescale = cute.math.exp2(row_max[r] * scale_log2 - safe_max * scale_log2, fastmath=True)
    row_sum[r] = row_sum[r] * rescale + probs.reduce(cute.ReductionOp.ADD, f32.zero, 0)
    row_max[r] = new_max
    out[r, None] = out[r, None].load() * rescale
    scores[r, None] = probs


def swizzled_rows(dim: int, rows: int, *stages: int):
    """Shared-memory layout for `rows` x `dim` bf16 tiles (times `stages`) that ldmatrix reads without
    bank conflicts: a 3-bit (64-column) or 2-bit (32-column) swizzle."""
    cols = 64 if dim % 64 == 0 else 32
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if cols == 64 else 2, 3, 3), 0, cute.make_layout((8, cols), stride=(cols, 1))
    )
    return cute.tile_to_shape(atom, (rows, dim, *stages), tuple(range(2 + len(stages))))


def row_copy(dtype, threads: int, dim: int, copy_op):
    """Tiled copy of 16-byte chunks: threads cover whole 64- (or 32-) column row segments."""
    vec = 128 // dtype.width
    lanes_per_row = (64 if dim % 64 == 0 else 32) // vec
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(copy_op, dtype, num_bits_per_copy=128),
        cute.make_layout((threads // lanes_per_row, lanes_per_row), stride=(lanes_per_row, 1)),
        cute.make_layout((1, vec)),
    )


@cute.jit
def copy_rows(
    tiled_copy: cute.TiledCopy, thr_copy, src: cute.Tensor, dst: cute.Tensor, num_rows, tile_shape: cutlass.Constexpr
):
    """Copy the first `num_rows` rows of the `tile_shape` tile `src` into shared memory `dst`; zero the rest."""
    src_part = thr_copy.partition_S(src)
    dst_part = thr_copy.partition_D(dst)
    coords = thr_copy.partition_S(cute.make_identity_tensor(tile_shape))
    for i in cutlass.range_constexpr(cute.size(dst_part, mode=[1])):
        if coords[0, i, 0][0] < num_rows:
            cute.copy(tiled_copy, src_part[None, i, None], dst_part[None, i, None])
        else:
            dst_part[None, i, None].fill(0)
