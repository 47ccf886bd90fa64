"""Compile time of every CuTeDSL kernel at the M3 shapes, and the cost of loading it from the disk cache.

    python kernels/bench/compile_time.py        (GPU machine; or CPU with CUTE_DSL_ARCH=sm_90a)

Uses a fresh cache directory, so the first column is a cold compile and the second a later
process's load of the exported object file (kernels.cute.compiled_kernel).
"""

import os
import tempfile
import time

from kernels import cute as cute_kernels
from kernels.cute.combine import CombineParams
from kernels.cute.proxy_scores import ProxyScoreParams
from kernels.cute.proxy_scores_prefill import PrefillProxyScoreParams
from kernels.cute.sparse_attn import SparseAttentionParams
from kernels.cute.sparse_attn_prefill import PrefillAttentionParams
from kernels.cute.topk_blocks import TopkBlocksParams

VARIANTS = [
    ("proxy_scores", ProxyScoreParams(4, 1, 128)),
    ("proxy_scores_prefill", PrefillProxyScoreParams(4, 1, 128)),
    ("topk_blocks", TopkBlocksParams(16, 1, 0)),
    ("sparse_attn", SparseAttentionParams(64, 4, 4, 128)),
    ("sparse_attn", SparseAttentionParams(64, 4, 4, 128, split=True)),
    ("sparse_attn_prefill", PrefillAttentionParams(64, 4, 4, 128, 16)),
    ("combine", CombineParams(64, 128)),
]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    os.environ["VLLM_MSA_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="vllm-msa-kernels-")
    print("| kernel | params | compile s | load from disk s |\n|---|---|---|---|")
    for module, params in VARIANTS:
        compile_s = timed(lambda: cute_kernels.compiled_kernel.__wrapped__(module, params))
        load_s = timed(lambda: cute_kernels.compiled_kernel.__wrapped__(module, params))
        print(f"| {module} | {params} | {compile_s:.2f} | {load_s:.3f} |")


if __name__ == "__main__":
    main()
