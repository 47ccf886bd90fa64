"""Benchmark: CuTeDSL proxy block scores (decode) vs the PyTorch reference and the H200's copy bandwidth.

    python kernels/bench/bench_proxy_scores.py   (on the GPU machine, CuTeDSL installed)

M3 proxy shapes: Hi 4, Hki 1, Dp 128, bf16 proxy keys; one query token per sequence.
Bytes per call = contexts * Dp * 2 (proxy keys) — the kernel's required traffic.
"""

import time

import torch

from kernels import cute as cute_kernels
from kernels import reference
from kernels.bench.timing import ceilings, timed
from kernels.shapes import MSAShape, PagedBatch


def main():
    shape = MSAShape(num_q_heads=64, num_kv_heads=4, head_dim=128, num_index_heads=4, num_index_key_heads=1,
                     index_head_dim=128, topk_blocks=16)
    bw, _ = ceilings()
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read+write)")
    print(f"{'context':>8} {'batch':>5} {'cute us':>9} {'torch us':>9} {'speedup':>8} {'GB/s':>8} {'% copy bw':>9}")
    t0 = time.time()
    for context in (8192, 32768, 131072):
        for batch in (1, 8, 32):
            blocks = context // 128
            pages = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
            proxy = torch.randn(batch * blocks, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, 4, 128, device="cuda", dtype=torch.bfloat16)
            pb = PagedBatch(
                query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
                block_table=pages,
            )
            t_cute = timed(lambda: cute_kernels.proxy_block_scores(q, proxy, pb, shape), iters=20)
            t_ref = timed(lambda: reference.proxy_block_scores(q, proxy, pb, shape), iters=3)
            nbytes = batch * context * 128 * 2
            print(f"{context:>8} {batch:>5} {t_cute * 1e6:>9.1f} {t_ref * 1e6:>9.1f} {t_ref / t_cute:>8.1f} "
                  f"{nbytes / t_cute / 1e9:>8.0f} {100 * nbytes / t_cute / bw:>8.0f}%")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
