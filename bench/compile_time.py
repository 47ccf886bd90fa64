"""Compile time of every CuTeDSL kernel at the M3 shapes, and the cost of loading it from the disk cache.

    python -m bench.compile_time        (GPU machine; or CPU with CUTE_DSL_ARCH=sm_90a)

Uses a fresh cache directory, so the first column is a cold compile and the second a later
process's load of the exported object file (msa_kernels.cute.runtime.compiled_kernel).
"""

import os
import tempfile
import time

from bench.problems import M3_SHAPE as S
from msa_kernels.cute.combine import CombineKernel, CombineParams
from msa_kernels.cute.index_scores import IndexScoreKernel, IndexScoreParams
from msa_kernels.cute.index_scores_fp8 import Fp8IndexScoreKernel, Fp8IndexScoreParams
from msa_kernels.cute.index_scores_prefill import PrefillIndexScoreKernel, PrefillIndexScoreParams
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.cute.sparse_attn import SparseAttentionKernel, SparseAttentionParams
from msa_kernels.cute.sparse_attn_prefill import PrefillAttentionKernel, PrefillAttentionParams
from msa_kernels.cute.topk_blocks import TopkBlocksKernel, TopkBlocksParams

VARIANTS = [
    (IndexScoreKernel, IndexScoreParams(S.num_index_heads, S.num_index_key_heads, S.index_head_dim)),
    (Fp8IndexScoreKernel, Fp8IndexScoreParams(S.num_index_heads, S.num_index_key_heads, S.index_head_dim)),
    (PrefillIndexScoreKernel, PrefillIndexScoreParams(S.num_index_heads, S.num_index_key_heads, S.index_head_dim)),
    (
        PrefillIndexScoreKernel,
        PrefillIndexScoreParams(S.num_index_heads, S.num_index_key_heads, S.index_head_dim, fp8=True),
    ),
    (TopkBlocksKernel, TopkBlocksParams(S.topk_blocks, S.local_blocks, S.init_blocks)),
    (SparseAttentionKernel, SparseAttentionParams(S.num_q_heads, S.num_kv_heads, S.num_index_heads, S.head_dim)),
    (
        SparseAttentionKernel,
        SparseAttentionParams(S.num_q_heads, S.num_kv_heads, S.num_index_heads, S.head_dim, split=True),
    ),
    (
        PrefillAttentionKernel,
        PrefillAttentionParams(S.num_q_heads, S.num_kv_heads, S.num_index_heads, S.head_dim, S.topk_blocks),
    ),
    (CombineKernel, CombineParams(S.num_q_heads, S.head_dim, 32)),
]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    os.environ["VLLM_MSA_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="vllm-msa-kernels-")
    print("| kernel | params | compile s | load from disk s |\n|---|---|---|---|")
    for kernel_cls, params in VARIANTS:
        compile_s = timed(lambda: compiled_kernel.__wrapped__(kernel_cls, params))
        load_s = timed(lambda: compiled_kernel.__wrapped__(kernel_cls, params))
        print(f"| {kernel_cls.__name__} | {params} | {compile_s:.2f} | {load_s:.3f} |")


if __name__ == "__main__":
    main()
