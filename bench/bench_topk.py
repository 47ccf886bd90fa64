"""Benchmark: the CuTeDSL top-k kernel by threads per row (msa_kernels/cute/topk_blocks.py), decode and prefill rows.

    python -m bench.bench_topk [--row-threads 32 128 256 512 1024] [--contexts 8192 32768 131072 1048576]
        (GPU machine, CuTeDSL installed)

M3's selection (top-16 of 128-token blocks, the query's own block forced) on random fp32 block scores, -inf past
each token's block as the index-score kernels leave them. Decode: one row per (sequence, index head) at the end of
each context, batch 1 / 8 / 32, timed in CUDA graphs as vLLM replays decode. Prefill: every token of one prompt
of the context (rows = tokens x Hi), timed eagerly. Each choice of threads per row is checked against the PyTorch
reference on every shape before it is timed; the fastest is marked (topk_blocks.row_threads holds the choice).
"""

import argparse

import torch

from bench.problems import DECODE_BATCHES, M3_SHAPE
from bench.timing import graph_timed, timed
from msa_kernels import reference
from msa_kernels.cute import topk_blocks


def block_scores(positions: torch.Tensor, max_blocks: int, seed: int) -> torch.Tensor:
    """Random [T, Hi, max_blocks] fp32 scores, -inf past each token's block."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    size = (positions.shape[0], M3_SHAPE.num_index_heads, max_blocks)
    scores = torch.randn(size, device="cuda", generator=generator)
    blocks = torch.arange(max_blocks, device="cuda")
    return scores.masked_fill(blocks > (positions // M3_SHAPE.block_size)[:, None, None], float("-inf"))


def time_row_threads(name: str, positions: torch.Tensor, max_blocks: int, row_threads: list[int], graphs: bool):
    scores = block_scores(positions, max_blocks, seed=max_blocks)
    want = reference.topk_blocks(scores, positions, M3_SHAPE)
    times = {}
    for threads in row_threads:
        got = topk_blocks.topk_blocks(scores, positions, M3_SHAPE, threads=threads)
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: {threads} threads per row select other blocks than the reference")
        call = lambda: topk_blocks.topk_blocks(scores, positions, M3_SHAPE, threads=threads)  # noqa: E731
        times[threads] = (graph_timed if graphs else timed)(call)
    best = min(times, key=times.get)
    cells = [f"{t * 1e6:.1f}{' *' if threads == best else ''}" for threads, t in times.items()]
    print(f"| {name} | {positions.shape[0] * M3_SHAPE.num_index_heads} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-threads", type=int, nargs="+", default=[32, 128, 256, 512, 1024])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    parser.add_argument("--prefill-contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: top-{M3_SHAPE.topk_blocks} blocks, us per call (* fastest)\n")
    print("| shape | rows | " + " | ".join(f"{t} threads/row" for t in args.row_threads) + " |")
    print("|---|---|" + "---|" * len(args.row_threads))
    for context in args.contexts:
        blocks = -(-context // M3_SHAPE.block_size)
        for batch in DECODE_BATCHES:
            positions = torch.full((batch,), context - 1, dtype=torch.int32, device="cuda")
            time_row_threads(f"decode {context} x {batch}", positions, blocks, args.row_threads, graphs=True)
    for context in args.prefill_contexts:
        positions = torch.arange(context, dtype=torch.int32, device="cuda")
        blocks = -(-context // M3_SHAPE.block_size)
        time_row_threads(f"prefill {context}", positions, blocks, args.row_threads, graphs=False)


if __name__ == "__main__":
    main()
