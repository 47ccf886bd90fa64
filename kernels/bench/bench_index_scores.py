"""Benchmark: CuTeDSL index block scores (decode) vs the PyTorch reference and the H200's copy bandwidth.

    python kernels/bench/bench_index_scores.py   (on the GPU machine, CuTeDSL installed)

M3 index shapes: Hi 4, Hki 1, Dp 128, bf16 index keys; one query token per sequence
(kernels/cute/index_scores.py). Bytes per call = contexts * Dp * 2 (index keys) — the kernel's
required traffic.
"""

import time

from msa_kernels import reference
from msa_kernels.bench.problems import CONTEXTS, DECODE_BATCHES, M3_SHAPE, paged_problem
from msa_kernels.bench.timing import ceilings, timed
from msa_kernels.cute import index_scores


def main():
    bw, _ = ceilings()
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read+write)")
    print(f"{'context':>8} {'batch':>5} {'cute us':>9} {'torch us':>9} {'speedup':>8} {'GB/s':>8} {'% copy bw':>9}")
    t0 = time.time()
    for context in CONTEXTS:
        for batch in DECODE_BATCHES:
            pb, _, q, _, index_keys, _ = paged_problem([(context, 1)] * batch)
            t_cute = timed(lambda: index_scores.index_block_scores(q, index_keys, pb, M3_SHAPE), iters=20)
            t_ref = timed(lambda: reference.index_block_scores(q, index_keys, pb, M3_SHAPE), iters=3)
            nbytes = batch * context * M3_SHAPE.index_head_dim * 2
            print(
                f"{context:>8} {batch:>5} {t_cute * 1e6:>9.1f} {t_ref * 1e6:>9.1f} {t_ref / t_cute:>8.1f} "
                f"{nbytes / t_cute / 1e9:>8.0f} {100 * nbytes / t_cute / bw:>8.0f}%"
            )
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
