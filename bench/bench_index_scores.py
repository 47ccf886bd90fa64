"""Benchmark: CuTeDSL index block scores (decode) on bf16 and on FP8 index keys, against the PyTorch reference
and the H200's copy bandwidth, and the whole decode MSA layer (ops.msa_attention) on each index-key cache.

    python -m bench.bench_index_scores   (on the GPU machine, CuTeDSL installed)

M3 index shapes: Hi 4, Hki 1, Dp 128; one query token per sequence. The same keys run as bf16 pages
(kernels/msa_kernels/cute/index_scores.py) and as FP8 pages (msa_kernels.fp8_index_keys, quantised once;
kernels/msa_kernels/cute/index_scores_fp8.py) in the same run. Bytes
per call are the kernel's required traffic: contexts * Dp * 2 (bf16 keys), contexts * (Dp + 4) (e4m3 keys
and their float32 scales). The layer columns replay the layer from a CUDA graph (as vLLM's decode runs it),
index keys bf16 and FP8, K/V bf16; "layer fp8/bf16" is issue 17's decode target (<= 0.6 at 128K x 32).
The bf16 kernel loads 16 key elements a lane for a single token and 8 for more (index_scores.lane_elems_for).
"""

import time

from bench.problems import CONTEXTS, DECODE_BATCHES, M3_SHAPE, SCALE, paged_problem
from bench.timing import ceilings, graph_timed, timed
from msa_kernels import ops, reference
from msa_kernels.cute import index_scores, index_scores_fp8
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.plan import StepPlan


def main():
    bw, _ = ceilings()
    dp = M3_SHAPE.index_head_dim
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read+write)")
    print(
        f"{'context':>8} {'batch':>5} {'cute us':>9} {'torch us':>9} {'speedup':>8} {'GB/s':>8} {'% copy bw':>9} "
        f"{'fp8 us':>9} {'fp8/bf16':>8} {'fp8 GB/s':>8} {'fp8 % bw':>9} "
        f"{'layer us':>9} {'layer fp8 us':>12} {'layer fp8/bf16':>14}"
    )
    t0 = time.time()
    for context in CONTEXTS:
        for batch in DECODE_BATCHES:
            pb, attn_q, q, kv, index_keys, _ = paged_problem([(context, 1)] * batch)
            plan = StepPlan.of(pb)
            fp8_keys = Fp8IndexKeyCache.quantize(index_keys)
            t_cute = timed(lambda: index_scores.index_block_scores(q, index_keys, pb, M3_SHAPE), iters=20)
            t_fp8 = timed(lambda: index_scores_fp8.fp8_index_block_scores(q, fp8_keys, pb, M3_SHAPE), iters=20)
            t_ref = timed(lambda: reference.index_block_scores(q, index_keys, pb, M3_SHAPE), iters=3)
            layer = [
                graph_timed(lambda: ops.msa_attention(attn_q, q, kv, keys, plan, M3_SHAPE, SCALE))
                for keys in (index_keys, fp8_keys)
            ]
            nbytes = batch * context * dp * 2
            fp8_bytes = batch * context * (dp + 4)
            print(
                f"{context:>8} {batch:>5} {t_cute * 1e6:>9.1f} {t_ref * 1e6:>9.1f} {t_ref / t_cute:>8.1f} "
                f"{nbytes / t_cute / 1e9:>8.0f} {100 * nbytes / t_cute / bw:>8.0f}% "
                f"{t_fp8 * 1e6:>9.1f} {t_fp8 / t_cute:>8.2f} {fp8_bytes / t_fp8 / 1e9:>8.0f} "
                f"{100 * fp8_bytes / t_fp8 / bw:>8.0f}% "
                f"{layer[0] * 1e6:>9.1f} {layer[1] * 1e6:>12.1f} {layer[1] / layer[0]:>14.2f}"
            )
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
