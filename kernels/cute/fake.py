"""Symbolic tensors for compiling the kernels without real inputs (CI on CPU, or ahead of the first call).

A compiled CuTeDSL function takes each tensor argument as the runtime tensor's own packed values,
with no check against the compiled signature, so the symbolic tensor must be dynamic exactly where
the runtime one is. runtime.as_cute passes tensors through from_dlpack(...).mark_layout_dynamic(last
dim): every extent is a 32-bit runtime value, every stride but the unit innermost one a 64-bit
runtime value. The kernels take their static sizes from their parameter dataclasses instead.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor


def row_major(dtype: type[cutlass.Numeric], rank: int, *, align: int | None = None) -> cute.Tensor:
    """A fully dynamic row-major tensor of `rank` modes; strides are multiples of 16 bytes when align=16.

    Callers must pass tensors that honour that: as_cute checks strides before a call.
    """
    vec = max(1, (align or 1) * 8 // dtype.width)
    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(cute.sym_int64(divisibility=vec) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)
