"""How much of a decode step's K/V the step before already read: the number that decides a host tier for K/V (issue 50).

    python -m bench.selection_reuse runs/trained-selections.pt [--from 0.5] [--capacities 1 2 4 8] [--out FILE.md]

Reads training/trained_selections.py's file (the trained pass-key model's top-k per token and index head on pass-key
prompts of each context) and treats consecutive positions as consecutive decode steps of one request (position t
selects as the t-th decode step would: its own block forced, every earlier block visible). For the positions from
--from x context to the end (long context):

  head reuse   per index head, the share of a step's k blocks that the same head selected the step before;
  page reuse   the K/V pages the step reads (a page holds every KV head of its block, so the union of the index
               heads' blocks) found among the pages the step before read;
  tier hits    a device tier of C x (Hi x k) pages (the most a step can read) for the one request, run by the
               host tier's own step and policy (msa_kernels.host_tier.resolve: CLOCK): the share of a step's pages
               already in it, and the pages a step copies in from host memory (misses), mean and p99; a device
               tier as large as the context (its pages in the first column) always hits;

each beside the same numbers for independent random block scores at the same shape (what no trained index head
would do: the worst case). CPU only, minutes (a resolve per position and capacity).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from msa_kernels.host_tier import PageCache, resolve, step_blocks
from msa_kernels.shapes import MSAShape
from training.trained_selections import random_selection


def step_pages(blocks: torch.Tensor) -> list[set[int]]:
    """The pages each position reads, from step_blocks' rows (the union of its index heads' blocks, -1 padded)."""
    return [set(row[row >= 0].tolist()) for row in blocks]


def head_reuse(selected: torch.Tensor, start: int) -> float:
    """Mean share of a position's blocks, per index head, that the head selected at the position before."""
    shares = []
    for t in range(max(start, 1), selected.shape[0]):
        for h in range(selected.shape[1]):
            now, before = selected[t, h], selected[t - 1, h]
            now = set(now[now >= 0].tolist())
            shares.append(len(now & set(before[before >= 0].tolist())) / len(now))
    return float(np.mean(shares))


def page_reuse(pages: list[set[int]], start: int) -> float:
    return float(np.mean([len(pages[t] & pages[t - 1]) / len(pages[t]) for t in range(max(start, 1), len(pages))]))


def tier_hits(blocks: torch.Tensor, start: int, capacity: int) -> tuple[float, float, float]:
    """(hit rate, mean misses per step, p99 misses per step) of a device tier of `capacity` pages for one request
    under the host tier's own step (msa_kernels.host_tier: step_blocks, resolve), positions as consecutive decode
    steps, warmed on the positions before `start`; blocks: step_blocks of the positions' selections."""
    num_host_pages = int(blocks.max()) + 1
    cache = PageCache.empty(capacity, num_host_pages)
    host_block_table = torch.arange(num_host_pages, dtype=torch.int32)[None]  # block b on host page b
    hits = requests = 0
    misses = []
    for t in range(blocks.shape[0]):
        resolution = resolve(cache, blocks[t : t + 1], host_block_table)
        if t >= start:
            hit, missed = int(resolution.hits), int(resolution.misses)
            hits += hit
            requests += hit + missed
            misses.append(missed)
    return hits / requests, float(np.mean(misses)), float(np.percentile(misses, 99))


def random_like(selected: torch.Tensor, block_size: int) -> torch.Tensor:
    """trained_selections' random selection (the top-k of independent normal block scores) at the selection's shape,
    from a fixed seed."""
    context, heads, k = selected.shape
    torch.manual_seed(0)
    return random_selection(context, MSAShape(heads, heads, 1, heads, 1, 1, k, block_size=block_size))


def report(selections: dict[int, torch.Tensor], start_fraction: float, capacities: list[int], block_size: int) -> str:
    lines = [
        "| context (pages) | selections | head reuse | page reuse | "
        + " | ".join(f"tier {c}x: hit, misses mean / p99" for c in capacities)
        + " |",
        "|---|---|---|---|" + "---|" * len(capacities),
    ]
    for context, trained in sorted(selections.items()):
        start = int(context * start_fraction)
        context_pages = -(-context // block_size)
        for name, selected in (("trained", trained.int()), ("random", random_like(trained, block_size))):
            blocks = step_blocks(selected)  # each position's pages, once for every column
            pages = step_pages(blocks)
            per_step = selected.shape[1] * selected.shape[2]
            cells = []
            for c in capacities:
                hit, mean_misses, p99 = tier_hits(blocks, start, c * per_step)
                cells.append(f"{hit:.2f}, {mean_misses:.1f} / {p99:.0f}")
            reuse = f"{head_reuse(selected, start):.2f} | {page_reuse(pages, start):.2f}"
            lines.append(f"| {context} ({context_pages}) | {name} | {reuse} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("selections", type=Path, help="training/trained_selections.py's output")
    parser.add_argument("--from", dest="start", type=float, default=0.5, help="first position, x context")
    parser.add_argument("--capacities", type=int, nargs="+", default=[1, 2, 4, 8], help="device tier, x (Hi x k) pages")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", type=Path, help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    saved = torch.load(args.selections)
    selections = {int(c): s for c, s in saved["contexts"].items()}
    print(
        f"{args.selections}: {saved['model']}, MSA layer {saved['layer']}, top-{saved['topk']}, key at depth "
        f"{saved['depth']}; positions from {args.start:g} x context",
        flush=True,
    )
    table = report(selections, args.start, args.capacities, args.block_size)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
