"""Benchmark: the served metrics' selection totals of one step (msa_kernels.selection_stats), the CuTeDSL kernel
against the PyTorch path it replaces on Hopper.

    python3 -m bench.bench_selection_stats [--tokens 1 32 128 2048 8192]

M3's selection shape (Hi 4, K 16, 128-token blocks), T query tokens at random positions of a 128K context, each
selection as top-k leaves it; decode-sized T counted as decode tokens, larger T as prefill. Each path's time per
step in a CUDA graph (as vLLM replays decode: GPU time alone) and eagerly (what a step with prompt tokens pays,
host included), with the GPU kernels each launches (counted by the profiler) and the kernel's totals checked
against the PyTorch path's first.
"""

import argparse

import torch

from bench.timing import graph_timed, timed
from msa_kernels import selection_stats
from msa_kernels.cute import selection_stats as cute_selection_stats
from msa_kernels.shapes import M3_SHAPE

CONTEXT = 131072
LAYERS = 57  # m3-layer-mix's MSA layers
DECODE_TOKENS_AT_MOST = 128


def problem(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """selected [T, Hi, K] int32 (the own block and K - 1 distinct earlier ones) and positions [T] int32, on the GPU."""
    shape = M3_SHAPE
    positions = torch.randint(shape.block_size * shape.topk_blocks, CONTEXT, (num_tokens,), dtype=torch.int32)
    own = positions // shape.block_size
    earlier = torch.rand(num_tokens, shape.num_index_heads, own.max().item()).argsort(-1)[..., : shape.topk_blocks - 1]
    earlier = earlier % own[:, None, None]  # earlier blocks (repeats possible; top-k's count is what is timed)
    selected = torch.cat([own[:, None, None].expand(-1, shape.num_index_heads, 1), earlier], -1)
    return selected.to(torch.int32).cuda(), positions.cuda()


def kernels_launched(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(event.count for event in prof.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 2048, 8192])
    args = parser.parse_args()
    torch.manual_seed(0)
    fields = len(selection_stats.SELECTION_FIELDS)
    print(
        f"GPU: {torch.cuda.get_device_name()}; M3 selections (Hi {M3_SHAPE.num_index_heads}, K "
        f"{M3_SHAPE.topk_blocks}), {CONTEXT}-token context, {LAYERS} layers"
    )
    print("| T | path | kernels | graph us | eager us | graph: torch / kernel |\n|---|---|---|---|---|---|")
    for num_tokens in args.tokens:
        selected, positions = problem(num_tokens)
        decode_tokens = num_tokens if num_tokens <= DECODE_TOKENS_AT_MOST else 0
        totals = {name: torch.zeros(fields, dtype=torch.float64, device="cuda") for name in ("kernel", "torch")}
        paths = {"kernel": cute_selection_stats.add_selection_stats, "torch": selection_stats.add_selection_stats}
        for name, add in paths.items():
            add(totals[name], selected, positions, M3_SHAPE.block_size, decode_tokens, LAYERS)
        exact = [i for i in range(fields) if selection_stats.SELECTION_FIELDS[i] != "read_fraction_sum"]
        assert torch.equal(totals["kernel"][exact], totals["torch"][exact]), (totals["kernel"], totals["torch"])
        graph_us = {}
        for name, add in paths.items():

            def step(add=add, name=name):
                add(totals[name], selected, positions, M3_SHAPE.block_size, decode_tokens, LAYERS)

            graph_us[name] = graph_timed(step, iters=20) * 1e6
            eager_us = timed(step, iters=20) * 1e6
            ratio = f"{graph_us['torch'] / graph_us['kernel']:.1f}" if name == "torch" else ""
            launched = kernels_launched(step)
            print(f"| {num_tokens} | {name} | {launched} | {graph_us[name]:.1f} | {eager_us:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
