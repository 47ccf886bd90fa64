"""Symbolic arguments for compiling the kernels without real inputs (CI on CPU, or ahead of the first call).

The kernels compile for CuTeDSL's TVM-FFI calling convention (runtime.compiled_kernel): the compiled
function takes torch tensors as they are and checks each against its symbolic tensor here before the
launch, raising ValueError on a mismatch: dtype, rank, CUDA device (one for all tensors), every extent
a 32-bit value, the innermost stride 1, the other strides multiples of the declared divisibility and
the base address aligned as declared (modes of extent 1 skip the stride checks). The kernels take
their static sizes from their parameter dataclasses instead.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor


def row_major(dtype: type[cutlass.Numeric], rank: int, *, align: int | None = None) -> cute.Tensor:
    """A fully dynamic row-major tensor of `rank` modes; base and strides 16-byte aligned when align=16.

    The compiled function refuses (ValueError) a tensor whose base or outer strides break that.
    """
    vec = max(1, (align or 1) * 8 // dtype.width)
    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(cute.sym_int64(divisibility=vec) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def env_stream():
    """The stream argument, which callers do not pass: the compiled function launches on torch's current
    stream of the tensors' device (TVM-FFI's environment stream), so the kernels run in order with torch
    ops and inside CUDA graph capture."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)
