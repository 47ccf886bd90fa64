"""Sweep of the prefill attention kernel's K/V stages per CTA and the adaptive union bound.

    python kernels/bench/sweep_prefill_attention.py   (on the GPU machine, CuTeDSL installed)

Same problems as bench_prefill_attention.py (M3 shapes, one sequence; window 1 = neighbouring tokens
select independently, window 16 = they mostly agree). For each: the per-token kernel's time, then
per stage count (1, 2, 3) the prefill kernel alone (bound 10**6) and the adaptive mode with union
bounds 44, 38, 32 and 24 blocks, each with its output cosine against the per-token kernel.
"""

import functools

import torch

import kernels.cute.sparse_attn_prefill as prefill_kernel
from kernels import cute as cute_kernels
from kernels.bench.bench_prefill_attention import SHAPE, mean_union, problem
from kernels.bench.timing import timed


def main():
    params = prefill_kernel.PrefillAttentionParams
    for context, window in ((131072, 1), (131072, 16), (32768, 1)):
        batch, q, kv, selected = problem(context, window, seed=context + window)

        def attend(**kw):
            return cute_kernels.sparse_attention(q, kv, batch, selected, SHAPE, 0.088, **kw)

        reference = attend(kernel="per_token").float()
        t_ref = timed(lambda: attend(kernel="per_token"), iters=3)
        print(context, window, f"union {mean_union(selected):.1f} per_token {t_ref * 1e3:.2f} ms", flush=True)
        for stages in (1, 2, 3):
            # sparse_attention builds the params itself: give it this stage count
            prefill_kernel.PrefillAttentionParams = functools.partial(params, stages=stages)
            for bound in (10**6, 44, 38, 32, 24):
                run = functools.partial(attend, kernel="prefill", max_union=bound)
                cos = torch.nn.functional.cosine_similarity(run().float().flatten(), reference.flatten(), dim=0)
                print(f"  stages {stages} max_union {bound}: {timed(run, iters=3) * 1e3:.2f} ms cos {cos.item():.5f}",
                      flush=True)
        prefill_kernel.PrefillAttentionParams = params


if __name__ == "__main__":
    main()
