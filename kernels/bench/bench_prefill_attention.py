"""Benchmark: prefill sparse attention, per-token kernel vs prefill (token-tile) kernel vs dense, in one run.

    python kernels/bench/bench_prefill_attention.py   (on the GPU machine, CuTeDSL installed)

M3 shapes (Hq 64, Hkv 4, D 128, Hi 4, k 16, bf16), one sequence whose tokens are all new. The two
CuTeDSL kernels compute the same function:
  per-token  sparse_attn.py: one (token, index head) per CTA, 16 rows on mma.sync; each token reads
             its own 16 blocks.
  prefill    sparse_attn_prefill.py: 4 consecutive tokens x 16 heads = 64 rows on wgmma, K/V by TMA;
             the CTA reads the union of the 4 tokens' blocks once (rows mask the blocks they did not
             select).
  adaptive   what serving runs (kernels.cute.sparse_attention's default for prefill): the prefill kernel for
             the tiles whose union has at most PREFILL_MAX_UNION x 64 blocks, per-token for the rest.
The prefill kernel's cost follows the union size, so the block selections are made with three
degrees of agreement between neighbouring tokens: the block scores of token t are a moving sum of
`window` independent normal draws (window 1: every token independent, the worst case for grouping;
window w: neighbours' scores correlate as 1 - lag / w). The table prints the measured mean union per
4-token group (16 = every token picked the same blocks, 61 = none shared beyond the local block).

Useful FLOPs = 4 * tokens * Hq * D * keys of whole selected blocks (the per-token definition; the
prefill kernel's masked rows are not counted), against the bf16 matmul rate measured in the same
run. Dense = torch SDPA (flash backend) on the same context.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import cute as cute_kernels
from kernels import reference
from kernels.bench.timing import ceilings, timed
from kernels.shapes import MSAShape, PagedBatch

SHAPE = MSAShape(num_q_heads=64, num_kv_heads=4, head_dim=128, num_index_heads=4, num_index_key_heads=1,
                 index_head_dim=128, topk_blocks=16)
GROUP = cute_kernels.prefill_tile_tokens(SHAPE)  # tokens per prefill tile: 4 for M3 (64 rows / 16 heads)


def correlated_scores(tokens: int, blocks: int, window: int, generator: torch.Generator) -> torch.Tensor:
    """[tokens, Hi, blocks] fp32 block scores: a moving sum of `window` normal draws along the tokens."""
    out = torch.empty(tokens, SHAPE.num_index_heads, blocks, device="cuda")
    for h in range(SHAPE.num_index_heads):
        noise = torch.randn(tokens + window, blocks, device="cuda", generator=generator)
        sums = torch.cumsum(noise, 0)
        out[:, h] = (sums[window:] - sums[:-window]) / window**0.5
        del noise, sums
    return out


def mean_union(selected: torch.Tensor) -> float:
    """Mean number of distinct blocks per (GROUP consecutive tokens, index head)."""
    t = selected.shape[0] // GROUP * GROUP
    groups = selected[:t].view(-1, GROUP, SHAPE.num_index_heads, SHAPE.topk_blocks).transpose(1, 2)
    flat = groups.reshape(*groups.shape[:2], -1).sort(-1).values
    distinct = (flat[..., 1:] != flat[..., :-1]) & (flat[..., 1:] >= 0)
    return (distinct.sum(-1) + (flat[..., 0] >= 0)).float().mean().item()


def problem(context: int, window: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-context // 128)
    pages = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(1, blocks)
    kv = torch.randn(blocks, 2, 128, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(context, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=g).to(torch.bfloat16)
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, context], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
        block_table=pages,
    )
    selected = reference.topk_blocks(correlated_scores(context, blocks, window, g), batch.positions, SHAPE)
    return batch, q, kv, selected


def dense_time(context: int) -> float:
    q = torch.randn(1, SHAPE.num_q_heads, context, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, SHAPE.num_kv_heads, context, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), iters=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    start = time.time()
    bw, flops = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s\n")
    print("| tokens | window | mean union / 4 tokens | per-token ms | prefill ms | adaptive ms | TFLOP/s | % matmul "
          "| adaptive / per-token | output cosine | dense SDPA ms | dense / adaptive |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        t_dense = dense_time(context)
        for window in args.windows:
            batch, q, kv, selected = problem(context, window, seed=context + window)
            useful = 4 * (selected >= 0).sum().item() * 128 * SHAPE.heads_per_index_head * SHAPE.head_dim
            modes = {"per_token": dict(kernel="per_token"), "prefill": dict(kernel="prefill", max_union=10**6),
                     "adaptive": dict(kernel="prefill")}
            run = {mode: (lambda kw=kw: cute_kernels.sparse_attention(q, kv, batch, selected, SHAPE, 0.088, **kw))
                   for mode, kw in modes.items()}
            outs = {mode: fn().float() for mode, fn in run.items()}
            cos = min(F.cosine_similarity(outs["per_token"].flatten(), outs[mode].flatten(), dim=0).item()
                      for mode in ("prefill", "adaptive"))
            t = {mode: timed(fn, iters=3) for mode, fn in run.items()}
            print(f"| {context} | {window} | {mean_union(selected):.1f} | {t['per_token'] * 1e3:.2f} | "
                  f"{t['prefill'] * 1e3:.2f} | {t['adaptive'] * 1e3:.2f} | {useful / t['adaptive'] / 1e12:.0f} | "
                  f"{100 * useful / t['adaptive'] / flops:.0f}% | {t['adaptive'] / t['per_token']:.2f} | {cos:.5f} | "
                  f"{t_dense * 1e3:.2f} | {t_dense / t['adaptive']:.1f}x |", flush=True)
            del batch, q, kv, selected, outs
            torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
