"""msa_kernels.fp8_index_keys.quantize_rows on the device, for rows spread over neighbouring lanes: each of a
row's lanes_per_row lanes (a power of two dividing 32, aligned in the warp) holds one slice of the row.

quantize_row_slice  a lane's float32 slice -> its e4m3 values and the row's float32 scale

The reference's function bit for bit: amax = max |x| over the row (exact), scale = max(amax, 1e-4) / 448 and
values = x / scale, each an IEEE round-to-nearest float32 division (div.rn.f32, as the reference divides on
CPU and on CUDA), then cvt.rn.satfinite.e4m3x2.f32: round to nearest even, saturated at +-448, where the
reference clamps to +-448 before its round-to-nearest-even conversion. The index-score kernel rounds index
queries with it, the index-key write kernel the keys it caches.
"""

import cutlass
import cutlass.cute as cute

from msa_kernels.fp8_index_keys import E4M3_MAX, MIN_AMAX


def quantize_row_slice(x: cute.TensorSSA, lanes_per_row: int) -> tuple[cute.TensorSSA, cutlass.Float32]:
    """This lane's slice of a row as e4m3 values, and the row's scale (every lane of the row gets it)."""
    slice_amax = abs(x).reduce(cute.ReductionOp.MAX, cutlass.Float32(0.0), reduction_profile=0)
    amax = cute.arch.warp_reduction_max(slice_amax, threads_in_group=lanes_per_row)
    scale = cute.arch.fmax(amax, cutlass.Float32(MIN_AMAX)) / cutlass.Float32(E4M3_MAX)
    return (x / scale).to(cutlass.Float8E4M3FN), scale
