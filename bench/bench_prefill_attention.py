"""Benchmark: prefill sparse attention, per-token kernel vs prefill (token-tile) kernel vs dense, in one run.

    python -m bench.bench_prefill_attention   (on the GPU machine, CuTeDSL installed)

M3 shapes (Hq 64, Hkv 4, D 128, Hi 4, k 16, bf16), one sequence whose tokens are all new. The two
CuTeDSL kernels compute the same function:
  per-token  sparse_attn.py: one (token, index head) per CTA, 16 rows on mma.sync; each token reads
             its own 16 blocks.
  prefill    sparse_attn_prefill.py, what serving runs for a prefill: 4 consecutive tokens x 16 heads = 64
             rows on wgmma, K/V by TMA; the CTA reads the union of the 4 tokens' blocks once (rows mask the
             blocks they did not select).
The prefill kernel's cost follows the union size, so the block selections are made with three
degrees of agreement between neighbouring tokens (problems.prefill_problem: the block scores of
token t are a moving sum of `window` independent normal draws; window 1: every token independent,
the worst case for grouping). The table prints the measured mean union per 4-token group (16 =
every token picked the same blocks, 61 = none shared beyond the local block). --trained FILE adds a row
per context the file holds (training/trained_selections.py: the selections of the pass-key model trained
with MSA, models/needle-msa, at M3's top-16): window "trained".

Useful FLOPs = 4 * tokens * Hq * D * keys of whole selected blocks (the per-token definition; the
prefill kernel's masked rows are not counted), against the bf16 matmul rate measured in the same
run. Dense = torch SDPA (flash backend) on the same context.
"""

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.problems import CONTEXTS, M3_SHAPE, SCALE, load_trained_selections, mean_union, prefill_problem
from bench.timing import ceilings, timed
from msa_kernels.cute import sparse_attn, sparse_attn_prefill

TILE = sparse_attn_prefill.ROWS // M3_SHAPE.heads_per_index_head  # tokens per prefill tile: 4 for M3 (64 / 16)


def dense_time(context: int) -> float:
    q = torch.randn(1, M3_SHAPE.num_q_heads, context, M3_SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, M3_SHAPE.num_kv_heads, context, M3_SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), iters=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--trained", help="training/trained_selections.py's file: a row per context it holds")
    args = parser.parse_args()
    trained = load_trained_selections(args.trained) if args.trained else {}
    start = time.time()
    bw, flops = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s\n")
    print(
        "| tokens | window | mean union / 4 tokens | per-token ms | prefill ms | TFLOP/s | % matmul "
        "| prefill / per-token | output cosine | dense SDPA ms | dense / prefill |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for context in sorted({*args.contexts, *trained}):
        t_dense = dense_time(context)
        windows = [*(args.windows if context in args.contexts else []), *(["trained"] if context in trained else [])]
        for window in windows:
            if window == "trained":
                batch, q, kv, selected = prefill_problem(context, 1, seed=context, selected=trained[context])
            else:
                batch, q, kv, selected = prefill_problem(context, window, seed=context + window)
            useful = (
                4
                * (selected >= 0).sum().item()
                * M3_SHAPE.block_size
                * M3_SHAPE.heads_per_index_head
                * M3_SHAPE.head_dim
            )
            problem = (q, kv, batch, selected, M3_SHAPE, SCALE)
            run = {
                "per_token": functools.partial(sparse_attn.sparse_attention, *problem),
                "prefill": functools.partial(sparse_attn_prefill.prefill_sparse_attention, *problem),
            }
            outs = {mode: fn().float() for mode, fn in run.items()}
            cos = F.cosine_similarity(outs["per_token"].flatten(), outs["prefill"].flatten(), dim=0).item()
            t = {mode: timed(fn, iters=3) for mode, fn in run.items()}
            print(
                f"| {context} | {window} | {mean_union(selected, TILE):.1f} | {t['per_token'] * 1e3:.2f} | "
                f"{t['prefill'] * 1e3:.2f} | {useful / t['prefill'] / 1e12:.0f} | "
                f"{100 * useful / t['prefill'] / flops:.0f}% | {t['prefill'] / t['per_token']:.2f} | {cos:.5f} | "
                f"{t_dense * 1e3:.2f} | {t_dense / t['prefill']:.1f}x |",
                flush=True,
            )
            del batch, q, kv, selected, problem, run, outs
            torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
