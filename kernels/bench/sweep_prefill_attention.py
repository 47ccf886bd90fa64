"""Sweep of the prefill attention kernel's K/V stages per CTA and the adaptive union bound.

    python kernels/bench/sweep_prefill_attention.py   (on the GPU machine, CuTeDSL installed)

Same problems as bench_prefill_attention.py (problems.prefill_problem: M3 shapes, one sequence;
window 1 = neighbouring tokens select independently, window 16 = they mostly agree). For each: the
per-token kernel's time, then per stage count (1, 2, 3) the prefill kernel alone (bound 10**6) and
the adaptive mode with union bounds 44, 38, 32 and 24 blocks, each with its output cosine against
the per-token kernel.
"""

import functools

import torch

from msa_kernels.bench.problems import M3_SHAPE, SCALE, mean_union, prefill_problem
from msa_kernels.bench.timing import timed
from msa_kernels.cute import sparse_attn, sparse_attn_prefill

TILE = sparse_attn_prefill.ROWS // M3_SHAPE.heads_per_index_head


def main():
    for context, window in ((131072, 1), (131072, 16), (32768, 1)):
        batch, q, kv, selected = prefill_problem(context, window, seed=context + window)
        problem = (q, kv, batch, selected, M3_SHAPE, SCALE)
        reference = sparse_attn.sparse_attention(*problem).float()
        t_ref = timed(lambda: sparse_attn.sparse_attention(*problem), iters=3)
        print(context, window, f"union {mean_union(selected, TILE):.1f} per_token {t_ref * 1e3:.2f} ms", flush=True)
        for stages in (1, 2, 3):
            for bound in (10**6, 44, 38, 32, 24):
                run = functools.partial(
                    sparse_attn_prefill.prefill_sparse_attention, *problem, max_union=bound, stages=stages
                )
                cos = torch.nn.functional.cosine_similarity(run().float().flatten(), reference.flatten(), dim=0)
                print(
                    f"  stages {stages} max_union {bound}: {timed(run, iters=3) * 1e3:.2f} ms cos {cos.item():.5f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
