"""First-call compile time of every CuTeDSL kernel at the M3 shapes, and whether CuTeDSL's on-disk
cache served it. Run twice in fresh processes: the second run shows the cached cost.

    python kernels/bench/compile_time.py
"""

import os
import time

from kernels.cute.combine import CombineParams, compile_combine
from kernels.cute.proxy_scores import ProxyScoreParams, compile_proxy_scores
from kernels.cute.sparse_attn import SparseAttentionParams, compile_sparse_attention

VARIANTS = {
    "proxy scores (Hi 4, Hki 1, Dp 128)": lambda: compile_proxy_scores(ProxyScoreParams(4, 1, 128)),
    "sparse attention (64/4/4, D 128)": lambda: compile_sparse_attention(SparseAttentionParams(64, 4, 4, 128)),
    "sparse attention split-K": lambda: compile_sparse_attention(SparseAttentionParams(64, 4, 4, 128, split=True)),
    "combine (Hq 64, D 128)": lambda: compile_combine(CombineParams(64, 128)),
}


def main():
    from cutlass.base_dsl.cache_helpers import get_default_generated_ir_path

    print(f"CuTeDSL cache dir: {os.environ.get('CUTE_DSL_CACHE_DIR') or get_default_generated_ir_path()}")
    for name, compile_fn in VARIANTS.items():
        t = time.perf_counter()
        compile_fn()
        print(f"{name:40s} {time.perf_counter() - t:6.2f} s")


if __name__ == "__main__":
    main()
