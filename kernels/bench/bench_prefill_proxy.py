"""Prefill proxy scores (kernels/cute/proxy_scores_prefill.py) at M3 shapes: time, TFLOP/s against the
bf16 matmul rate measured in the same run, and the whole MSA prefill layer (ops.msa_attention).

    PYTHONPATH=$PWD:$PYTHONPATH python3 kernels/bench/bench_prefill_proxy.py [--modules M ...]

One sequence of N new tokens, pages shuffled. FLOPs count the causal half of the tokens x keys
scores (2 x Hi x Dp x N x (N + 128) / 2). --modules times other kernel files of kernels/cute with
the same parameters side by side (an earlier commit's file copied there under another name, say).
"""

import argparse

import torch

from kernels import cute as cute_kernels
from kernels import ops
from kernels.bench.bench_sparse_attention import SHAPE, paged_problem
from kernels.bench.timing import ceilings, timed
from kernels.cute.proxy_scores_prefill import PrefillProxyScoreParams


def proxy_time(module, index_q, proxy, batch) -> float:
    """One kernel call per iteration on prepared arguments (the -inf fill and conversions excluded)."""
    params = PrefillProxyScoreParams(SHAPE.num_index_heads, SHAPE.num_index_key_heads, SHAPE.index_head_dim)
    kernel = cute_kernels.compiled_kernel(module, params)
    out = torch.full((batch.num_tokens, SHAPE.num_index_heads, batch.block_table.shape[1]), float("-inf"),
                     device="cuda")
    args = (cute_kernels._cute(index_q, rows16=True), cute_kernels._cute(proxy, rows16=True),
            cute_kernels._cute(batch.block_table), cute_kernels._cute(batch.positions),
            cute_kernels._cute(batch.request_tiles(cute_kernels.PREFILL_TILE_TOKENS)), cute_kernels._cute(out),
            cute_kernels._stream())
    return timed(lambda: kernel(*args), iters=5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="*", default=[], help="more kernel modules of kernels/cute to time")
    args = parser.parse_args()
    modules = ["proxy_scores_prefill", *args.modules]
    _, matmul = ceilings()
    print(f"bf16 matmul {matmul / 1e12:.0f} TFLOP/s\n")
    print("| tokens | " + " | ".join(f"{m} ms | TFLOP/s | % matmul" for m in modules) + " | MSA layer ms |")
    print("|---|" + "---|---|---|" * len(modules) + "---|")
    for n in (8192, 32768, 131072):
        batch, q, index_q, kv, proxy, _ = paged_problem(1, n, n)
        flops = 2 * SHAPE.num_index_heads * SHAPE.index_head_dim * n * (n + SHAPE.block_size) / 2
        cells = []
        for module in modules:
            t = proxy_time(module, index_q, proxy, batch)
            cells.append(f"{t * 1e3:.2f} | {flops / t / 1e12:.0f} | {flops / t / matmul:.0%}")
        layer = timed(lambda: ops.msa_attention(q, index_q, kv, proxy, batch, SHAPE, 0.088), iters=3)
        print(f"| {n} | " + " | ".join(cells) + f" | {layer * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
