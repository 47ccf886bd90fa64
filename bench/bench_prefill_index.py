"""Prefill index scores (kernels/msa_kernels/cute/index_scores_prefill.py) at M3 shapes, bf16 and FP8 index keys side by
side: time, TFLOP/s against the bf16 and e4m3 matmul rates measured in the same run, and the whole MSA
prefill layer (ops.msa_attention) with each index-key cache.

    python3 -m bench.bench_prefill_index [--contexts N ...]
        [--new-tokens C] [--modules M ...]

One sequence of N tokens, pages shuffled; all N are new, or with --new-tokens C the last C of them (a chunk
of a chunked prefill: at 1M the block scores of every token would not fit). FLOPs count the scores each new
token computes: 2 x Hi x Dp x its visible keys, counted in whole 128-key blocks as the kernel computes them.
Kernels are timed on prepared operands (for FP8: e4m3 queries), then both variants through the launcher as
ops calls it ("call ms": the -inf fill, the tile list and, for FP8, the queries' rounding: what a prefill step
pays); "FP8 / bf16" divides those two.
--modules times the bf16 PrefillIndexScoreKernel of other kernel files of kernels/cute with the same
parameters side by side (an earlier commit's file copied there under another name, say).
"""

import argparse
import importlib

import torch

from bench.problems import CONTEXTS, M3_SHAPE, SCALE, paged_problem
from bench.timing import ceilings, fp8_matmul_rate, timed
from msa_kernels import ops
from msa_kernels.cute import index_scores_prefill
from msa_kernels.cute.runtime import compiled_kernel
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache, quantize_rows
from msa_kernels.plan import StepPlan


def kernel_time(source, params, operands: tuple, batch) -> float:
    """One call of source's PrefillIndexScoreKernel per iteration on prepared operands (the -inf fill and the
    tiles excluded)."""
    kernel = compiled_kernel(source.PrefillIndexScoreKernel, params)
    out = torch.full(
        (batch.num_tokens, M3_SHAPE.num_index_heads, batch.block_table.shape[1]), float("-inf"), device="cuda"
    )
    tiles = batch.request_tiles(source.PREFILL_TILE_TOKENS)
    return timed(lambda: kernel(*operands, batch.block_table, batch.positions, tiles, out), iters=5)


def bf16_kernel_time(module: str, index_q, index_keys, batch) -> float:
    """kernel_time of a module's bf16 kernel (a file from before the FP8 variant takes no scale arguments)."""
    source = importlib.import_module(f"msa_kernels.cute.{module}")
    params = source.PrefillIndexScoreParams(
        M3_SHAPE.num_index_heads, M3_SHAPE.num_index_key_heads, M3_SHAPE.index_head_dim
    )
    operands = (index_q, None, index_keys, None) if hasattr(params, "fp8") else (index_q, index_keys)
    return kernel_time(source, params, operands, batch)


def score_flops(batch) -> float:
    keys = (batch.positions.double() // M3_SHAPE.block_size + 1) * M3_SHAPE.block_size
    return 2 * M3_SHAPE.num_index_heads * M3_SHAPE.index_head_dim * keys.sum().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", nargs="*", type=int, default=list(CONTEXTS), help="context lengths N")
    parser.add_argument("--new-tokens", type=int, help="time the last C tokens of each context (default: all)")
    parser.add_argument("--modules", nargs="*", default=[], help="more kernel modules of kernels/cute to time")
    args = parser.parse_args()
    _, matmul = ceilings()
    fp8_matmul = fp8_matmul_rate()
    print(f"bf16 matmul {matmul / 1e12:.0f} TFLOP/s, e4m3 matmul {fp8_matmul / 1e12:.0f} TFLOP/s (fast accumulation)\n")
    modules = ["index_scores_prefill", *args.modules]
    print(
        "| tokens | new | "
        + " | ".join(f"{m} bf16 ms | TFLOP/s | % bf16 matmul" for m in modules)
        + " | FP8 ms | TFLOP/s | % e4m3 matmul | call ms bf16 | call ms FP8 | FP8 / bf16 | layer ms bf16 |"
        + " layer ms FP8 |"
    )
    print("|---|---|" + "---|---|---|" * len(modules) + "---|---|---|---|---|---|---|---|")
    fp8_params = index_scores_prefill.PrefillIndexScoreParams(
        M3_SHAPE.num_index_heads, M3_SHAPE.num_index_key_heads, M3_SHAPE.index_head_dim, fp8=True
    )
    for n in args.contexts:
        new = min(args.new_tokens or n, n)
        batch, q, index_q, kv, index_keys, _ = paged_problem([(n, new)])
        fp8_keys = Fp8IndexKeyCache.quantize(index_keys)
        flops = score_flops(batch)
        cells = []
        for module in modules:
            t = bf16_kernel_time(module, index_q, index_keys, batch)
            cells.append(f"{t * 1e3:.2f} | {flops / t / 1e12:.0f} | {flops / t / matmul:.0%}")
        fp8_operands = (*quantize_rows(index_q), fp8_keys.values, fp8_keys.scales)
        t8 = kernel_time(index_scores_prefill, fp8_params, fp8_operands, batch)
        cells.append(f"{t8 * 1e3:.2f} | {flops / t8 / 1e12:.0f} | {flops / t8 / fp8_matmul:.0%}")
        calls = [  # the launcher as ops calls it: the -inf fill, the tiles and, for FP8, the queries' rounding
            timed(lambda: index_scores_prefill.prefill_index_block_scores(index_q, keys, batch, M3_SHAPE), iters=5)
            for keys in (index_keys, fp8_keys)
        ]
        cells.append(f"{calls[0] * 1e3:.2f} | {calls[1] * 1e3:.2f} | {calls[1] / calls[0]:.2f}")
        for keys in (index_keys, fp8_keys):
            plan = StepPlan.of(batch)
            layer = timed(lambda: ops.msa_attention(q, index_q, kv, keys, plan, M3_SHAPE, SCALE), iters=3)
            cells.append(f"{layer * 1e3:.2f}")
        print(f"| {n} | {new} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
