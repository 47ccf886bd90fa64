"""Benchmark: CuTeDSL MSA layer steps vs dense attention on the same shapes, on one GPU, in one run.

    python -m bench.bench_sparse_attention [--trained FILE] [--sections decode fp8_kv splits prefill]
        (on the GPU machine, CuTeDSL installed)

M3 shapes: Hq 64, Hkv 4, D 128, Hi 4, Hki 1, Dp 128, k 16, bf16. Ceilings measured in the same run:
device copy bandwidth and an 8192^3 bf16 matmul. Dense attention is torch SDPA on contiguous K/V
(the backend it picked is printed). Block selections come from random block scores: decode cost
depends only on how many blocks are picked; prefill attention's on how many neighbouring tokens
share (bench_prefill_attention.py measures that). --trained FILE (training/trained_selections.py) adds
decode rows whose sparse attention reads the blocks the trained pass-key model selects: the last `batch`
tokens of its prompt of that context, one per sequence (each index head reads its own KV head's pages,
so the time should follow the number of blocks, not which: the rows check it); the MSA layer and dense,
which make or need no selection, are the random rows'.

decode:  one query token per sequence; sparse attention (sparse_attn.sparse_attention, split-K) bytes =
         K/V of the selected blocks; MSA layer = index scores + top-k + sparse attention
         (msa_kernels.ops.msa_attention). Timed inside CUDA graphs (what vLLM replays for decode); the
         eager layer time shows the host overhead.
fp8_kv:  the decode sparse attention over an FP8 K/V cache of the same selections (half the bytes).
splits:  the decode split-K sweep, the attention kernel and combine.py timed apart.
prefill: one sequence of N new tokens; sparse attention (sparse_attn_prefill.prefill_sparse_attention)
         FLOPs = 4 * tokens * Hq * D * keys read; index scores (index_scores_prefill) FLOPs = 2 * Hi *
         Dp * tokens x keys of the visible blocks; MSA layer as for decode.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.problems import CONTEXTS, DECODE_BATCHES, M3_SHAPE, SCALE, load_trained_selections, paged_problem
from bench.timing import ceilings, graph_timed, timed
from msa_kernels import ops, reference
from msa_kernels.cute import index_scores_prefill, sparse_attn, sparse_attn_prefill
from msa_kernels.cute.combine import combine_splits
from msa_kernels.plan import StepPlan

SECTIONS = ["decode", "fp8_kv", "splits", "prefill"]


def dense_attention(q, k, v):
    """torch SDPA, causal for prefill, with the first fused backend that takes these GQA inputs."""
    causal = q.shape[2] > 1
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ):

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        try:
            run()
            return backend.name, run
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def selected_kv_bytes(batch: int, context: int) -> int:
    """K and V bytes of the blocks a decode token selects, over the batch (bf16)."""
    blocks = min(M3_SHAPE.topk_blocks, context // M3_SHAPE.block_size)
    return batch * M3_SHAPE.num_index_heads * blocks * M3_SHAPE.block_size * M3_SHAPE.head_dim * 2 * 2


def decode(bw, trained: dict):
    print("\n## decode (one token per sequence; CUDA-graph times, eager in brackets)\n")
    print(
        "| context | batch | selection | sparse attn us | GB/s | % copy bw | MSA layer us | dense SDPA us "
        "| MSA layer vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(context, batch, "random") for context in CONTEXTS for batch in DECODE_BATCHES]
    rows += [(context, batch, "trained") for context in sorted(trained) for batch in DECODE_BATCHES]
    for context, batch, selection in rows:
        pb, q, index_q, kv, index_keys, selected = paged_problem([(context, 1)] * batch)
        nbytes = selected_kv_bytes(batch, context)
        if selection == "trained":  # the sparse attention of the trained model's picks; layer and dense as random
            selected = trained[context][-batch:].to(selected.device)
            t_sparse = graph_timed(lambda: sparse_attn.sparse_attention(q, kv, pb, selected, M3_SHAPE, SCALE))
            print(
                f"| {context} | {batch} | trained | {t_sparse * 1e6:.1f} | {nbytes / t_sparse / 1e9:.0f} | "
                f"{100 * nbytes / t_sparse / bw:.0f}% | - | - | - |"
            )
            continue
        sparse = lambda: sparse_attn.sparse_attention(q, kv, pb, selected, M3_SHAPE, SCALE)  # noqa: E731
        plan = StepPlan.of(pb)
        layer = lambda: ops.msa_attention(q, index_q, kv, index_keys, plan, M3_SHAPE, SCALE)  # noqa: E731
        t_sparse, t_layer = graph_timed(sparse), graph_timed(layer)
        t_layer_eager = timed(layer)
        dq = q.view(batch, 1, M3_SHAPE.num_q_heads, M3_SHAPE.head_dim).transpose(1, 2)
        dk = torch.randn(batch, M3_SHAPE.num_kv_heads, context, M3_SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
        name, dense = dense_attention(dq, dk, torch.randn_like(dk))
        t_dense = graph_timed(dense)
        del dk
        print(
            f"| {context} | {batch} | random | {t_sparse * 1e6:.1f} | {nbytes / t_sparse / 1e9:.0f} | "
            f"{100 * nbytes / t_sparse / bw:.0f}% | {t_layer * 1e6:.1f} ({t_layer_eager * 1e6:.0f}) | "
            f"{t_dense * 1e6:.1f} ({name}) | {t_dense / t_layer:.1f}x |"
        )


def decode_fp8_kv(bw):
    """The decode sparse attention over an FP8 K/V cache (e4m3 pages, per-tensor scales) against bf16 pages of the
    same selections: time and the fraction of the copy bandwidth on the bytes each reads (FP8: half)."""
    print("\n## decode over an FP8 K/V cache (CUDA-graph times)\n")
    print("| context | batch | bf16 K/V us | FP8 K/V us | FP8 / bf16 | FP8 GB/s | FP8 % copy bw |")
    print("|---|---|---|---|---|---|---|")
    kv_scales = (0.05, 0.05)
    for context in CONTEXTS:
        for batch in DECODE_BATCHES:
            pb, q, _, kv, _, selected = paged_problem([(context, 1)] * batch)
            fp8_kv = reference.fp8_kv_cache(kv, kv_scales)
            nbytes = selected_kv_bytes(batch, context) // 2
            t_bf16 = graph_timed(lambda: sparse_attn.sparse_attention(q, kv, pb, selected, M3_SHAPE, SCALE))
            t_fp8 = graph_timed(
                lambda: sparse_attn.sparse_attention(q, fp8_kv, pb, selected, M3_SHAPE, SCALE, kv_scales=kv_scales)
            )
            print(
                f"| {context} | {batch} | {t_bf16 * 1e6:.1f} | {t_fp8 * 1e6:.1f} | {t_fp8 / t_bf16:.2f} | "
                f"{nbytes / t_fp8 / 1e9:.0f} | {100 * nbytes / t_fp8 / bw:.0f}% |"
            )


def decode_splits(bw):
    """Split-K sweep at the longest context, batch 1 and the largest batch: what sparse_attn.num_splits chooses
    against every split count (a split takes a run of the selection's K/V tiles), with the attention kernel and
    combine.py's merge timed apart."""
    context = CONTEXTS[-1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    params = sparse_attn.SparseAttentionParams(
        M3_SHAPE.num_q_heads, M3_SHAPE.num_kv_heads, M3_SHAPE.num_index_heads, M3_SHAPE.head_dim
    )
    tiles = M3_SHAPE.topk_blocks * params.tiles_per_block
    resident = sparse_attn.resident_ctas_per_sm(params) * sms
    for batch in (1, DECODE_BATCHES[-1]):
        pb, q, _, kv, _, selected = paged_problem([(context, 1)] * batch)
        nbytes = selected_kv_bytes(batch, context)
        out = torch.empty_like(q)
        print(f"\n## decode split-K sweep ({context} x {batch})\n")
        print("| splits | tiles per split | sparse attn us | attention kernel us | combine us | % copy bw |")
        print("|---|---|---|---|---|---|")
        chosen, _ = sparse_attn.num_splits(batch, params, tiles, resident)
        for splits in sorted({1, 2, 4, 8, 16, 32, chosen}):
            t = graph_timed(lambda: sparse_attn.sparse_attention(q, kv, pb, selected, M3_SHAPE, SCALE, splits=splits))
            plan = sparse_attn._launch_plan(M3_SHAPE, batch, M3_SHAPE.topk_blocks, splits, False, 0)
            lse = torch.empty((plan.splits, batch, M3_SHAPE.num_q_heads), dtype=torch.float32, device="cuda")
            partial = torch.empty((plan.splits, *q.shape), dtype=torch.float32, device="cuda")
            target = partial if plan.splits > 1 else out.view(1, *q.shape)
            arguments = (q, kv, pb.block_table, pb.seq_lens, pb.token_requests, pb.positions, selected, target, lse)
            t_kernel = graph_timed(lambda: plan.kernel(*arguments, SCALE, 1.0, plan.tiles_per_split))
            t_combine = graph_timed(lambda: combine_splits(partial, lse, out)) if plan.splits > 1 else 0.0
            mark = f" (chosen; {resident} resident CTAs)" if splits == chosen else ""
            print(
                f"| {plan.splits}{mark} | {plan.tiles_per_split} | {t * 1e6:.1f} | "
                f"{t_kernel * 1e6:.1f} | {t_combine * 1e6:.1f} | {100 * nbytes / t / bw:.0f}% |"
            )


def prefill(flops):
    print("\n## prefill (one sequence, all tokens new)\n")
    print(
        "| tokens | sparse attn ms | TFLOP/s | % matmul | index scores ms | TFLOP/s | MSA layer ms | dense SDPA ms "
        "| sparse attn vs dense | MSA layer vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for context in CONTEXTS:
        pb, q, index_q, kv, index_keys, selected = paged_problem([(context, context)])
        t_sparse = timed(
            lambda: sparse_attn_prefill.prefill_sparse_attention(q, kv, pb, selected, M3_SHAPE, SCALE), iters=3
        )
        # upper bound: whole blocks
        keys = (selected >= 0).sum().item() * M3_SHAPE.block_size * M3_SHAPE.heads_per_index_head
        fl = 4 * keys * M3_SHAPE.head_dim
        t_index = timed(
            lambda: index_scores_prefill.prefill_index_block_scores(index_q, index_keys, pb, M3_SHAPE), iters=3
        )
        blocks = context // M3_SHAPE.block_size
        # over the visible blocks
        index_fl = (
            2 * M3_SHAPE.num_index_heads * M3_SHAPE.index_head_dim * context * M3_SHAPE.block_size * (blocks + 1) / 2
        )
        plan = StepPlan.of(pb)
        t_layer = timed(lambda: ops.msa_attention(q, index_q, kv, index_keys, plan, M3_SHAPE, SCALE), iters=2)
        dq = q.view(1, context, M3_SHAPE.num_q_heads, M3_SHAPE.head_dim).transpose(1, 2)
        dk = torch.randn(1, M3_SHAPE.num_kv_heads, context, M3_SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
        name, dense = dense_attention(dq, dk, torch.randn_like(dk))
        t_dense = timed(dense, iters=2)
        print(
            f"| {context} | {t_sparse * 1e3:.2f} | {fl / t_sparse / 1e12:.0f} | {100 * fl / t_sparse / flops:.0f}% | "
            f"{t_index * 1e3:.2f} | {index_fl / t_index / 1e12:.0f} | {t_layer * 1e3:.2f} | "
            f"{t_dense * 1e3:.2f} ({name}) | "
            f"{t_dense / t_sparse:.1f}x | {t_dense / t_layer:.1f}x |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trained", help="training/trained_selections.py's file: decode rows with its selections")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="tables to run (all)")
    args = parser.parse_args()
    trained = load_trained_selections(args.trained) if args.trained else {}
    t0 = time.time()
    bw, flops = ceilings()
    print(
        f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )
    if "decode" in args.sections:
        decode(bw, trained)
    if "fp8_kv" in args.sections:
        decode_fp8_kv(bw)
    if "splits" in args.sections:
        decode_splits(bw)
    if "prefill" in args.sections:
        prefill(flops)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
