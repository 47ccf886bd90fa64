"""CuTeDSL kernel: the step's index keys quantised to e4m3 and stored into FP8 index-key pages, without a host sync.

Computes reference.write_index_keys for an Fp8IndexKeyCache (msa_kernels.fp8_index_keys' page layout): for each
token t whose flat slot s = slot_mapping[t] is not negative (negative: padding, skipped) and each index-key head
h, the row index_keys[t, h] of Dp bf16 elements is quantised (fp8_rows.quantize_row_slice: the reference's
rounding bit for bit) into values[s // B, s % B, h] (Dp e4m3 bytes) and scales[s // B, s % B, h] (float32).

Dp / 8 neighbouring lanes share a (token, head) row, each loading 16 bytes (8 bf16) and storing 8 e4m3 bytes,
so a warp reads and writes whole rows; a CTA of 128 threads takes 128 / (Dp / 8) consecutive rows (token-major)
and the first lane of a row stores its scale. The grid follows slot_mapping's length and the kernel reads the
slots on the device, so a decode step that writes FP8 index keys has no host sync and can be captured in a
CUDA graph (the reference's boolean indexing syncs). write_index_keys launches it.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.fp8_rows import quantize_row_slice
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache

if TYPE_CHECKING:
    import tvm_ffi

THREADS = 128
WARP = 32
VEC = 8  # bf16 elements per 16-byte load (and e4m3 bytes per store)


@dataclass(frozen=True)
class Fp8IndexKeyWriteParams:
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp

    @property
    def lanes_per_row(self) -> int:
        """Threads sharing one (token, head) row, each holding VEC contiguous elements."""
        return self.index_head_dim // VEC

    @property
    def rows_per_cta(self) -> int:
        return THREADS // self.lanes_per_row


class Fp8IndexKeyWriteKernel:
    def __init__(self, params: Fp8IndexKeyWriteParams):
        assert self.can_implement(torch.bfloat16, params.index_head_dim)
        self.p = params

    @classmethod
    def can_implement(cls, dtype: torch.dtype, index_head_dim: int) -> bool:
        """bf16 index keys whose rows are whole 16-byte loads of at most one warp."""
        return dtype == torch.bfloat16 and index_head_dim % VEC == 0 and WARP % (index_head_dim // VEC) == 0

    @staticmethod
    def fake_arguments(params: Fp8IndexKeyWriteParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        return (
            row_major(cutlass.BFloat16, 3, align=16),  # index_keys
            row_major(cutlass.Int64, 1),  # slot_mapping
            row_major(cutlass.Float8E4M3FN, 4, align=VEC),  # values
            row_major(cutlass.Float32, 3),  # scales
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        index_keys: cute.Tensor,  # [>= T, Hki, Dp] bf16
        slot_mapping: cute.Tensor,  # [T] int64, flat slots (page * B + token in page), < 0: skipped
        values: cute.Tensor,  # [pages, B, Hki, Dp] e4m3
        scales: cute.Tensor,  # [pages, B, Hki] fp32
        stream: cuda.CUstream,
    ):
        num_rows = cute.size(slot_mapping, mode=[0]) * self.p.num_index_key_heads
        grid = (num_rows + self.p.rows_per_cta - 1) // self.p.rows_per_cta
        self.kernel(index_keys, slot_mapping, values, scales, num_rows).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        index_keys: cute.Tensor,
        slot_mapping: cute.Tensor,
        values: cute.Tensor,
        scales: cute.Tensor,
        num_rows: cutlass.Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        block_size = cute.size(values, mode=[1])
        row = cta * p.rows_per_cta + tidx // p.lanes_per_row
        col = tidx % p.lanes_per_row
        token = row // p.num_index_key_heads
        head = row % p.num_index_key_heads
        slot = cutlass.Int64(-1)
        if row < num_rows:
            slot = slot_mapping[token]
        # Every lane quantises (zeros where its row is skipped): the row's amax is a shuffle of the whole warp.
        keys = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        keys.fill(0.0)
        if slot >= 0:
            cute.autovec_copy(cute.zipped_divide(index_keys[token, head, None], (VEC,))[(None, col)], keys)
        quantized, scale = quantize_row_slice(keys.load().to(cutlass.Float32), p.lanes_per_row)
        if slot >= 0:
            page = slot // block_size
            in_page = slot % block_size
            stored = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
            stored.store(quantized)
            cute.autovec_copy(stored, cute.zipped_divide(values[page, in_page, head, None], (VEC,))[(None, col)])
            if col == 0:
                scales[page, in_page, head] = scale


def write_index_keys(index_key_cache: Fp8IndexKeyCache, slot_mapping: torch.Tensor, index_keys: torch.Tensor) -> None:
    """Same contract as msa_kernels.reference.write_index_keys, for an FP8 cache and bf16 index keys [>= T, Hki, Dp]
    on Hopper (T = len(slot_mapping)): no host sync."""
    if slot_mapping.shape[0] == 0:
        return
    assert index_keys.shape[0] >= slot_mapping.shape[0]
    _kernel(index_keys.shape[1], index_keys.shape[2])(
        index_keys.contiguous(), slot_mapping.long(), index_key_cache.values, index_key_cache.scales
    )


@functools.cache
def _kernel(num_index_key_heads: int, index_head_dim: int) -> "tvm_ffi.Function":
    return compiled_kernel(Fp8IndexKeyWriteKernel, Fp8IndexKeyWriteParams(num_index_key_heads, index_head_dim))
