"""Prefill index scores (kernels/cute/index_scores_prefill.py) at M3 shapes: time, TFLOP/s against the
bf16 matmul rate measured in the same run, and the whole MSA prefill layer (ops.msa_attention).

    PYTHONPATH=$PWD:$PYTHONPATH python3 kernels/bench/bench_prefill_index.py [--modules M ...]

One sequence of N new tokens, pages shuffled. FLOPs count the causal half of the tokens x keys
scores (2 x Hi x Dp x N x (N + 128) / 2). --modules times the PrefillIndexScoreKernel of other
kernel files of kernels/cute with the same parameters side by side (an earlier commit's file copied
there under another name, say).
"""

import argparse
import importlib

import torch

from msa_kernels import ops
from msa_kernels.bench.problems import CONTEXTS, M3_SHAPE, SCALE, paged_problem
from msa_kernels.bench.timing import ceilings, timed
from msa_kernels.cute.runtime import compiled_kernel


def index_score_time(module, index_q, index_keys, batch) -> float:
    """One kernel call per iteration on prepared arguments (the -inf fill and the tiles excluded)."""
    source = importlib.import_module(f"msa_kernels.cute.{module}")
    params = source.PrefillIndexScoreParams(
        M3_SHAPE.num_index_heads, M3_SHAPE.num_index_key_heads, M3_SHAPE.index_head_dim
    )
    kernel = compiled_kernel(source.PrefillIndexScoreKernel, params)
    out = torch.full(
        (batch.num_tokens, M3_SHAPE.num_index_heads, batch.block_table.shape[1]), float("-inf"), device="cuda"
    )
    args = (
        index_q,
        index_keys,
        batch.block_table,
        batch.positions,
        batch.request_tiles(source.PREFILL_TILE_TOKENS),
        out,
    )
    return timed(lambda: kernel(*args), iters=5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="*", default=[], help="more kernel modules of kernels/cute to time")
    args = parser.parse_args()
    modules = ["index_scores_prefill", *args.modules]
    _, matmul = ceilings()
    print(f"bf16 matmul {matmul / 1e12:.0f} TFLOP/s\n")
    print("| tokens | " + " | ".join(f"{m} ms | TFLOP/s | % matmul" for m in modules) + " | MSA layer ms |")
    print("|---|" + "---|---|---|" * len(modules) + "---|")
    for n in CONTEXTS:
        batch, q, index_q, kv, index_keys, _ = paged_problem([(n, n)])
        flops = 2 * M3_SHAPE.num_index_heads * M3_SHAPE.index_head_dim * n * (n + M3_SHAPE.block_size) / 2
        cells = []
        for module in modules:
            t = index_score_time(module, index_q, index_keys, batch)
            cells.append(f"{t * 1e3:.2f} | {flops / t / 1e12:.0f} | {flops / t / matmul:.0%}")
        layer = timed(lambda: ops.msa_attention(q, index_q, kv, index_keys, batch, M3_SHAPE, SCALE), iters=3)
        print(f"| {n} | " + " | ".join(cells) + f" | {layer * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
