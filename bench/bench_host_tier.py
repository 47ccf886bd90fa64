"""Benchmark: what the host tier (vllm_msa/host_tier.py, issue 50) adds to an MSA decode layer on the GPU.

    python3 -m bench.bench_host_tier [--contexts 131072] [--batches 1 32] [--misses 0 4 16 64] [--device cpu]
        (GPU machine, serving kit: vLLM's view of pinned memory; --device cpu runs the steps on CPU tensors and checks
        the misses they count: a check, not a timing)

M3's attention shapes at decode, one layer call, as the tier serves it: the step resolved
(msa_kernels.ops.page_resolver: the CuTeDSL kernel on Hopper; beside it, in the same run, the torch ops of
msa_kernels.host_tier.resolve_step), the page copy (msa_kernels.ops.page_copier: the CuTeDSL kernel on Hopper, reading
the missed pages from pinned host memory through their device view), the write-through slots of the step's K/V
(PageCache.device_slots) and the resolved block table into the step's buffer: "tier steps" below, and the resolve
alone (the same calls without the copy and the slots). Beside it the layer's sparse attention on the same batch
(split-K + combine), which the tier steps come on top of.

Each request's step reads Hi x K = 64 distinct blocks (the most it can), of which --misses are new at every call and
the rest the same; the device tier holds exactly one step's pages (requests x 64: the least the option allows), so
the new blocks of a call evict the last call's and every call misses exactly that many pages a request (checked by
the tier's own counts before timing). Timed in CUDA graphs (host overhead removed, as vLLM replays decode), the
captured calls rotating over ROTATION selections. "host to device" is the missed pages' bytes over the tier steps'
time less their time at 0 misses, against a pinned 1 GiB host-to-device copy measured in the same run.
"""

import argparse
import itertools

import torch

from bench.problems import M3_SHAPE, SCALE, paged_problem
from bench.timing import graph_timed, timed
from msa_kernels import host_tier, ops
from msa_kernels.host_tier import PageCache
from msa_kernels.plan import StepPlan
from msa_kernels.shapes import PagedBatch

ROTATION = 10  # selections the captured calls rotate over


def host_to_device_bandwidth() -> float:
    """Bytes per second of a pinned 1 GiB host-to-device copy."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    return host.numel() / timed(lambda: device.copy_(host, non_blocking=True), iters=5)


def selections(requests: int, misses: int, device: str) -> list[torch.Tensor]:
    """ROTATION selections [R, Hi, K] of 64 distinct blocks a request: blocks 0..63-misses at every call, then
    `misses` blocks of the call's own."""
    shape = M3_SHAPE
    width = shape.num_index_heads * shape.topk_blocks
    kept = torch.arange(width - misses)
    rotation = []
    for call in range(ROTATION):
        fresh = width + call * misses + torch.arange(misses)
        blocks = torch.cat([kept, fresh]).view(shape.num_index_heads, shape.topk_blocks)
        rotation.append(blocks.expand(requests, -1, -1).contiguous().to(torch.int32).to(device))
    return rotation


class TierSteps:
    """One layer's host tier for `requests` decodes: host pages (pinned on a GPU) for the blocks the selections read,
    a device tier of one step's pages, and the tier steps of a layer call."""

    def __init__(self, requests: int, blocks: int, misses: int, device: str, resolver: str):
        shape = M3_SHAPE
        width = shape.num_index_heads * shape.topk_blocks
        used = width + ROTATION * misses  # the blocks a request's selections name
        page = (shape.num_kv_heads, shape.block_size, 2 * shape.head_dim)
        on_gpu = device == "cuda"
        host_pages = torch.randn((requests * used, *page), dtype=torch.bfloat16)
        self.host_pages = host_pages.pin_memory() if on_gpu else host_pages
        if on_gpu:
            from vllm_msa import compat  # vLLM's UVA view, as the served tier takes it

            self.host_view = compat.device_view_of_host_tensor(self.host_pages)
        else:
            self.host_view = self.host_pages
        self.device_pages = torch.empty((requests * width, *page), dtype=torch.bfloat16, device=device)
        self.cache = PageCache.empty(requests * width, requests * used, device)
        # Request r's block b (< used) on host page r * used + b; later blocks are never read.
        table = torch.full((requests, blocks), -1, dtype=torch.int32)
        table[:, :used] = (
            torch.arange(used, dtype=torch.int32) + used * torch.arange(requests, dtype=torch.int32)[:, None]
        )
        self.host_table = table.to(device)
        self.tier_table = torch.empty_like(self.host_table)
        self.slots = (self.host_table[:, 0].long() * shape.block_size).contiguous()  # each request's new token
        self.copy = ops.page_copier(torch.device(device))
        served = ops.page_resolver(torch.device(device), self.cache.num_pages)
        self.resolve_step = served if resolver == "served" else host_tier.resolve_step
        self.misses = torch.zeros((), dtype=torch.int64, device=device)

    def resolve(self, selected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.resolve_step(self.cache, selected, self.host_table, self.tier_table)

    def step(self, selected: torch.Tensor) -> None:
        copy_from, copy_to, _, misses = self.resolve(selected)
        self.copy(self.host_view, self.device_pages, copy_from, copy_to)
        self.cache.device_slots(self.slots, M3_SHAPE.block_size)
        self.misses += misses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--misses", type=int, nargs="+", default=[0, 4, 16, 64], help="new pages a request a call")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    shape = M3_SHAPE
    width = shape.num_index_heads * shape.topk_blocks
    if any(not 0 <= m <= width for m in args.misses):
        parser.error(f"--misses must be between 0 and Hi x K = {width}")
    if (least := shape.block_size * (width + ROTATION * max(args.misses))) > min(args.contexts):
        parser.error(f"--contexts must be at least {least} tokens: the blocks the selections of --misses name")
    on_gpu = args.device == "cuda"
    page_bytes = shape.num_kv_heads * shape.block_size * 2 * shape.head_dim * 2
    if on_gpu:
        bandwidth = host_to_device_bandwidth()
        print(f"{torch.cuda.get_device_name()}: the host tier's steps of one decode layer call (M3 shapes), us in a")
        print(f"CUDA graph; pinned host-to-device copy measured {bandwidth / 1e9:.1f} GB/s\n")
        print(
            "| context | batch | resolve | misses a request | tier steps us | of which resolve us "
            "| sparse attention us | tier / attention | host to device |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for context, requests in itertools.product(args.contexts, args.batches):
        blocks = -(-context // shape.block_size)
        if on_gpu:  # the layer's attention on the same batch, for scale
            batch, q, _, kv, _, chosen = paged_problem([(context, 1)] * requests)
            plan = StepPlan.of(PagedBatch(batch.query_start_loc, batch.seq_lens, batch.block_table, "decode"))
            attention_us = graph_timed(lambda: ops.sparse_attention(q, kv, plan, chosen, shape, SCALE)) * 1e6
        for resolver in ("served", "torch ops") if on_gpu else ("served",):
            base_us = None
            for misses in sorted(args.misses):
                tier = TierSteps(requests, blocks, misses, args.device, resolver)
                rotation = selections(requests, misses, args.device)
                for selected in rotation * 2:  # the first round fills the tier; the second misses as a steady call
                    tier.step(selected)
                tier.misses.zero_()
                for selected in rotation:
                    tier.step(selected)
                got = int(tier.misses)
                assert got == ROTATION * requests * misses, (
                    f"{got} misses in {ROTATION} calls, wanted {misses} a request"
                )
                if not on_gpu:
                    print(
                        f"context {context}, batch {requests}, {misses} misses a request: the tier's counts check out"
                    )
                    continue
                cycle = itertools.cycle(rotation)
                tier_us = graph_timed(lambda: tier.step(next(cycle)), iters=ROTATION) * 1e6
                resolve_us = graph_timed(lambda: tier.resolve(next(cycle)), iters=ROTATION) * 1e6
                base_us = tier_us if misses == 0 else base_us
                moved = ""
                if misses and base_us is not None and tier_us > base_us:
                    rate = requests * misses * page_bytes / ((tier_us - base_us) * 1e-6)
                    moved = f"{rate / 1e9:.1f} GB/s ({rate / bandwidth:.0%})"
                print(
                    f"| {context} | {requests} | {resolver} | {misses} | {tier_us:.1f} | {resolve_us:.1f} | "
                    f"{attention_us:.1f} | "
                    f"{tier_us / attention_us:.2f} | {moved} |"
                )


if __name__ == "__main__":
    main()
