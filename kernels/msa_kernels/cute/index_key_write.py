"""CuTeDSL kernel: the step's index keys stored into the index-key cache's pages, once, without a host sync.

Computes reference.write_index_keys: for each token t whose flat slot s = slot_mapping[t] is not negative
(negative: padding, skipped) and each index-key head h, the row index_keys[t, h] of Dp bf16 elements goes to
values[s // B, s % B, h]. A bf16 cache gets the row as it is; an FP8 cache (Fp8IndexKeyCache, params.fp8) gets it
quantised (fp8_rows.quantize_row_slice: the reference's rounding bit for bit) as Dp e4m3 bytes, and its scale in
scales[s // B, s % B, h] (float32).

Dp / 8 neighbouring lanes share a (token, head) row, each loading 16 bytes (8 bf16) and storing them (bf16) or 8
e4m3 bytes, so a warp reads and writes whole rows; a CTA of 128 threads takes 128 / (Dp / 8) consecutive rows
(token-major) and the first lane of an FP8 row stores its scale. The grid follows slot_mapping's length and the
kernel reads the slots on the device, so a decode step that writes index keys has no host sync and can be captured
in a CUDA graph (the reference's boolean indexing syncs). write_index_keys launches it.
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
class IndexKeyWriteParams:
    num_index_key_heads: int  # Hki
    index_head_dim: int  # Dp
    fp8: bool  # an Fp8IndexKeyCache (e4m3 values, float32 scales); else a bf16 cache

    @property
    def lanes_per_row(self) -> int:
        """Threads sharing one (token, head) row, each holding VEC contiguous elements."""
        return self.index_head_dim // VEC

    @property
    def rows_per_cta(self) -> int:
        return THREADS // self.lanes_per_row


class IndexKeyWriteKernel:
    def __init__(self, params: IndexKeyWriteParams):
        assert self.can_implement(torch.bfloat16, params.index_head_dim, params.fp8)
        self.p = params

    @classmethod
    def can_implement(cls, dtype: torch.dtype, index_head_dim: int, fp8: bool) -> bool:
        """bf16 index keys whose rows are whole 16-byte loads of a CTA; of one warp at most when quantised (the
        row's amax is a warp shuffle)."""
        lanes_per_row = index_head_dim // VEC
        return dtype == torch.bfloat16 and index_head_dim % VEC == 0 and (WARP if fp8 else THREADS) % lanes_per_row == 0

    @staticmethod
    def fake_arguments(params: IndexKeyWriteParams) -> tuple:
        """Symbolic-shape tensors for compiling without a GPU (CI) or ahead of the first call."""
        stored = cutlass.Float8E4M3FN if params.fp8 else cutlass.BFloat16
        return (
            row_major(cutlass.BFloat16, 3, align=16),  # index_keys
            row_major(cutlass.Int64, 1),  # slot_mapping
            row_major(stored, 4, align=VEC * stored.width // 8),  # values
            row_major(cutlass.Float32, 3) if params.fp8 else None,  # scales
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        index_keys: cute.Tensor,  # [>= T, Hki, Dp] bf16
        slot_mapping: cute.Tensor,  # [T] int64, flat slots (page * B + token in page), < 0: skipped
        values: cute.Tensor,  # [pages, B, Hki, Dp] e4m3 or bf16
        scales: cute.Tensor | None,  # FP8: [pages, B, Hki] fp32
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
        scales: cute.Tensor | None,
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
        keys = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        keys.fill(0.0)
        if slot >= 0:
            cute.autovec_copy(cute.zipped_divide(index_keys[token, head, None], (VEC,))[(None, col)], keys)
        page = slot // block_size
        in_page = slot % block_size
        if cutlass.const_expr(p.fp8):
            # Every lane quantises (zeros where its row is skipped): the row's amax is a shuffle of the whole warp.
            quantized, scale = quantize_row_slice(keys.load().to(cutlass.Float32), p.lanes_per_row)
            if slot >= 0:
                stored = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
                stored.store(quantized)
                cute.autovec_copy(stored, cute.zipped_divide(values[page, in_page, head, None], (VEC,))[(None, col)])
                if col == 0:
                    scales[page, in_page, head] = scale
        else:
            if slot >= 0:
                cute.autovec_copy(keys, cute.zipped_divide(values[page, in_page, head, None], (VEC,))[(None, col)])


def write_index_keys(
    index_key_cache: torch.Tensor | Fp8IndexKeyCache, slot_mapping: torch.Tensor, index_keys: torch.Tensor
) -> None:
    """Same contract as msa_kernels.reference.write_index_keys, for bf16 index keys [>= T, Hki, Dp] into a bf16 or
    an FP8 cache on Hopper (T = len(slot_mapping)): no host sync."""
    if slot_mapping.shape[0] == 0:
        return
    assert index_keys.shape[0] >= slot_mapping.shape[0]
    fp8 = isinstance(index_key_cache, Fp8IndexKeyCache)
    values, scales = (index_key_cache.values, index_key_cache.scales) if fp8 else (index_key_cache, None)
    _kernel(index_keys.shape[1], index_keys.shape[2], fp8)(index_keys.contiguous(), slot_mapping.long(), values, scales)


@functools.cache
def _kernel(num_index_key_heads: int, index_head_dim: int, fp8: bool) -> "tvm_ffi.Function":
    return compiled_kernel(IndexKeyWriteKernel, IndexKeyWriteParams(num_index_key_heads, index_head_dim, fp8))
