"""The dependent-launch floor of a decode layer: what a chain of kernels that do nothing costs on this GPU.

    python3 -m bench.launch_floor [--chain 4] [--ctas 1 64 132] [--repeats 50]

A decode MSA layer is a chain of kernels (index scores -> top-k -> sparse attention -> combine: --chain 4), each
reading what the one before wrote. Here each kernel of the chain does the least such a kernel does: one thread per
CTA reads a counter and writes it back plus one (a global load that depends on the kernel before, and a store).
The chains are captured in one CUDA graph (--repeats chains back to back, as vLLM replays decode) and timed per
chain, launched plainly and with programmatic dependent launch (PDL: griddepcontrol.wait first, as
msa_kernels/cute/pdl.py has every kernel of the served chain do), for CTA counts --ctas (1; the decode attention's
64 at batch 1; one per SM). The smallest per-chain time is the latency no design with that many kernels can beat;
fewer kernels, or PDL, move it.
"""

import argparse
import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from bench.timing import graph_timed
from msa_kernels.cute.fake import env_stream, row_major
from msa_kernels.cute.pdl import wait_for_previous_kernel
from msa_kernels.cute.runtime import compiled_kernel


@dataclass(frozen=True)
class LinkParams:
    pdl: bool  # launched with programmatic dependent launch, waiting on the kernel before


class LinkKernel:
    """One link of the chain: CTA c increments counter[c]; grid = the counter's length."""

    def __init__(self, params: LinkParams):
        self.p = params

    @staticmethod
    def fake_arguments(params: LinkParams) -> tuple:
        return (row_major(cutlass.Int32, 1), env_stream())

    @cute.jit
    def __call__(self, counter: cute.Tensor, stream: cuda.CUstream):
        ctas = cute.size(counter, mode=[0])
        self.kernel(counter).launch(grid=[ctas, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=self.p.pdl)

    @cute.kernel
    def kernel(self, counter: cute.Tensor):
        if cutlass.const_expr(self.p.pdl):
            wait_for_previous_kernel()
        thread, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if thread == 0:
            counter[cta] = counter[cta] + 1


@functools.cache
def link(pdl: bool):
    return compiled_kernel(LinkKernel, LinkParams(pdl))


def chain_time(chain: int, ctas: int, pdl: bool, repeats: int) -> float:
    """Seconds per chain of `chain` links over `ctas` CTAs, replayed from one CUDA graph of `repeats` chains."""
    counter = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    kernel = link(pdl)

    def run_chain():
        for _ in range(chain):
            kernel(counter)

    seconds = graph_timed(run_chain, iters=repeats)
    calls = 2 + 4 * repeats  # graph_timed: a warm-up and a side-stream call, then 4 replays (timed: 1 + 3)
    if not torch.equal(counter, torch.full_like(counter, calls * chain)):  # every link ran, in order or not
        raise RuntimeError(f"counter {counter.tolist()[:4]} after {calls} chains of {chain}: a link did not run")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, default=4, help="kernels per chain (a decode layer: 4)")
    parser.add_argument("--ctas", type=int, nargs="+", default=[1, 64, 132])
    parser.add_argument("--repeats", type=int, default=50, help="chains per CUDA graph")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: chains of {args.chain} kernels, {args.repeats} per CUDA graph")
    print("| CTAs | launch | us per chain | us per kernel |\n|---|---|---|---|")
    for ctas in args.ctas:
        for pdl in (False, True):
            seconds = chain_time(args.chain, ctas, pdl, args.repeats)
            name = "PDL" if pdl else "plain"
            print(f"| {ctas} | {name} | {seconds * 1e6:.2f} | {seconds * 1e6 / args.chain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
