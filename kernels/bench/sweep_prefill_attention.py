"""Sweep of the prefill attention kernel's warpgroups and K/V stages per CTA and the adaptive union bound.

    python kernels/bench/sweep_prefill_attention.py [--trained FILE]   (on the GPU machine, CuTeDSL installed)

Same problems as bench_prefill_attention.py (problems.prefill_problem: M3 shapes, one sequence;
window 1 = neighbouring tokens select independently, window 16 = they mostly agree; --trained FILE adds the
selections of the pass-key model trained with MSA at each context the file holds, training/trained_selections.py,
which the design should serve best: a trained model's neighbours agree in between). For each: the
per-token kernel's time on one warp a CTA and on four, the block-major kernel's (sparse_attn_by_block.py), then
per warpgroup count (1: 4 tokens a tile, 2: 8 sharing each page) and stage count (1, 2, 3; two warpgroups: 1, 2)
the prefill kernel alone (bound 10**6) and the adaptive mode with union bounds of 11, 9.5, 8 and 6 blocks a token
(44, 38, 32 and 24 for 4 tokens), the tiles it leaves on the per-token or the block-major kernel, each with its
output cosine against the per-token kernel.
"""

import argparse
import functools

import torch

from msa_kernels.bench.problems import M3_SHAPE, SCALE, load_trained_selections, mean_union, prefill_problem
from msa_kernels.bench.timing import timed
from msa_kernels.cute import sparse_attn, sparse_attn_by_block, sparse_attn_prefill

TOKENS = sparse_attn_prefill.ROWS // M3_SHAPE.heads_per_index_head  # a warpgroup's


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trained", help="training/trained_selections.py's file: a problem per context it holds")
    args = parser.parse_args()
    trained = load_trained_selections(args.trained) if args.trained else {}
    problems = [*((context, "trained") for context in sorted(trained)), (131072, 1), (131072, 16), (32768, 1)]
    for context, window in problems:
        if window == "trained":
            batch, q, kv, selected = prefill_problem(context, 1, seed=context, selected=trained[context])
        else:
            batch, q, kv, selected = prefill_problem(context, window, seed=context + window)
        problem = (q, kv, batch, selected, M3_SHAPE, SCALE)
        reference = sparse_attn.sparse_attention(*problem).float()
        t_ref = timed(lambda: sparse_attn.sparse_attention(*problem), iters=3)
        t_warps = timed(lambda: sparse_attn.sparse_attention(*problem, warps=4), iters=3)
        by_block = functools.partial(sparse_attn_by_block.prefill_sparse_attention_by_block, *problem)
        cos = torch.nn.functional.cosine_similarity(by_block().float().flatten(), reference.flatten(), dim=0)
        t_block = timed(by_block, iters=3)
        unions = ", ".join(f"{g} tokens {mean_union(selected, g):.1f}" for g in (TOKENS, 2 * TOKENS))
        print(
            f"{context} {window}: union {unions}; per_token {t_ref * 1e3:.2f} ms, on 4 warps {t_warps * 1e3:.2f} ms; "
            f"by block {t_block * 1e3:.2f} ms cos {cos.item():.5f}",
            flush=True,
        )
        for warpgroups in (1, 2):
            for stages in (1, 2, 3) if warpgroups == 1 else (1, 2):
                for blocks_a_token, leftovers in [(None, "per_token")] + [
                    (blocks, left) for blocks in (11, 9.5, 8, 6) for left in ("per_token", "by_block")
                ]:
                    bound = 10**6 if blocks_a_token is None else round(blocks_a_token * TOKENS * warpgroups)
                    run = functools.partial(
                        sparse_attn_prefill.prefill_sparse_attention,
                        *problem,
                        max_union=bound,
                        stages=stages,
                        warpgroups=warpgroups,
                        leftovers=leftovers,
                    )
                    cos = torch.nn.functional.cosine_similarity(run().float().flatten(), reference.flatten(), dim=0)
                    print(
                        f"  warpgroups {warpgroups} stages {stages} max_union {bound} leftovers {leftovers}: "
                        f"{timed(run, iters=3) * 1e3:.2f} ms cos {cos.item():.5f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
