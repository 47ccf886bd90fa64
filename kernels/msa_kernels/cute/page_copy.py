"""CuTeDSL kernel: the K/V pages a decode step misses, copied from host memory into the device tier, without a host
sync.

Computes msa_kernels.host_tier.copy_pages: for each entry n of the step's copy list whose copy_from[n] is not
negative (negative: padding, nothing copied), the page host_pages[copy_from[n]] goes to
device_pages[copy_to[n]]. The pages are seen as rows of 32-bit words (any dtype: bf16 and e4m3 pages copy alike),
the host pages through vLLM's device view of pinned host memory (UVA), so the loads cross PCIe. The list has a fixed
length (requests x Hi x K: every page a step can read) and the kernel reads it on the device, so a CTA whose entry
is padding returns at once: only the pages missed cross PCIe, and a decode step's copy can be captured in a CUDA
graph (the reference selects the copies by a mask, which syncs). A CTA of 128 threads copies CHUNK_WORDS of one
page, each thread 16 bytes a load.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.runtime import compiled_kernel

if TYPE_CHECKING:
    import tvm_ffi

THREADS = 128
VEC = 4  # 32-bit words per 16-byte load
CHUNK_WORDS = THREADS * VEC * 8  # words of a page one CTA copies (8 loads a thread): 16 KiB


@dataclass(frozen=True)
class PageCopyParams:
    page_words: int  # 32-bit words of a page (all of its heads, tokens, K and V)

    @property
    def chunks(self) -> int:
        return (self.page_words + CHUNK_WORDS - 1) // CHUNK_WORDS


class PageCopyKernel:
    def __init__(self, params: PageCopyParams):
        assert self.can_implement(params.page_words)
        self.p = params

    @classmethod
    def can_implement(cls, page_words: int) -> bool:
        """Pages of whole 16-byte loads."""
        return page_words > 0 and page_words % VEC == 0

    @staticmethod
    def fake_arguments(params: PageCopyParams) -> tuple:
        return (
            row_major(cutlass.Int32, 2, align=16),  # host_pages [host pages, page words]
            row_major(cutlass.Int32, 2, align=16),  # device_pages [device pages, page words]
            row_major(cutlass.Int32, 1),  # copy_from [N]
            row_major(cutlass.Int32, 1),  # copy_to [N]
            env_stream(),
        )

    @cute.jit
    def __call__(
        self,
        host_pages: cute.Tensor,
        device_pages: cute.Tensor,
        copy_from: cute.Tensor,
        copy_to: cute.Tensor,
        stream: cuda.CUstream,
    ):
        entries = cute.size(copy_from, mode=[0])
        self.kernel(host_pages, device_pages, copy_from, copy_to).launch(
            grid=[entries, self.p.chunks, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, host_pages: cute.Tensor, device_pages: cute.Tensor, copy_from: cute.Tensor, copy_to: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        entry, chunk, _ = cute.arch.block_idx()
        source = copy_from[entry]
        if source >= 0:
            target = copy_to[entry]
            words = cute.make_rmem_tensor((VEC,), cutlass.Int32)
            for i in cutlass.range_constexpr(CHUNK_WORDS // (THREADS * VEC)):
                word = chunk * CHUNK_WORDS + (i * THREADS + tidx) * VEC
                if word < self.p.page_words:
                    column = word // VEC
                    cute.autovec_copy(cute.zipped_divide(host_pages[source, None], (VEC,))[(None, column)], words)
                    cute.autovec_copy(words, cute.zipped_divide(device_pages[target, None], (VEC,))[(None, column)])


def copy_pages(
    host_pages: torch.Tensor, device_pages: torch.Tensor, copy_from: torch.Tensor, copy_to: torch.Tensor
) -> None:
    """Same contract as msa_kernels.host_tier.copy_pages, for pages [pages, ...] of 16-byte multiples: host_pages a
    CUDA view of pinned host memory (or any CUDA tensor), device_pages on the GPU, copy_from / copy_to [N] int32."""
    if copy_from.shape[0] == 0:
        return
    host_words, device_words = (
        pages.view(pages.shape[0], -1).view(torch.int32) for pages in (host_pages, device_pages)
    )
    _kernel(host_words.shape[1])(host_words, device_words, copy_from, copy_to)


@functools.cache
def _kernel(page_words: int) -> "tvm_ffi.Function":
    return compiled_kernel(PageCopyKernel, PageCopyParams(page_words))
