"""Benchmark: CuTeDSL MSA layer steps vs dense attention on the same shapes, on one GPU, in one run.

    python kernels/bench/bench_sparse_attention.py   (on the GPU machine, CuTeDSL installed)

M3 shapes: Hq 64, Hkv 4, D 128, Hi 4, Hki 1, Dp 128, k 16, bf16. Ceilings measured in the same run:
device copy bandwidth and an 8192^3 bf16 matmul. Dense attention is torch SDPA on contiguous K/V
(the backend it picked is printed). Block selections come from random block scores: decode cost
depends only on how many blocks are picked; prefill attention's on how many neighbouring tokens
share (bench_prefill_attention.py measures that).

decode:  one query token per sequence; sparse attention bytes = K/V of the selected blocks;
         MSA layer = proxy scores + top-k + sparse attention (kernels.ops.msa_attention). Timed inside
         CUDA graphs (what vLLM replays for decode); the eager layer time shows the host overhead.
prefill: one sequence of N new tokens; sparse attention FLOPs = 4 * tokens * Hq * D * keys read;
         proxy FLOPs = 2 * Hi * Dp * tokens x keys of the visible blocks; MSA layer as for decode.
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import cute as cute_kernels
from kernels import ops, reference
from kernels.bench.timing import ceilings, graph_timed, timed
from kernels.shapes import MSAShape, PagedBatch

SHAPE = MSAShape(num_q_heads=64, num_kv_heads=4, head_dim=128, num_index_heads=4, num_index_key_heads=1,
                 index_head_dim=128, topk_blocks=16)


def dense_attention(q, k, v):
    """torch SDPA, causal for prefill, with the first fused backend that takes these GQA inputs."""
    causal = q.shape[2] > 1
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        try:
            run()
            return backend.name, run
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def paged_problem(batch, context, q_len):
    blocks = -(-context // 128)
    shape = SHAPE
    pages = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    kv = torch.randn(batch * blocks, 2, 128, shape.num_kv_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    proxy = torch.randn(batch * blocks, 128, 1, shape.index_head_dim, device="cuda", dtype=torch.bfloat16)
    tokens = batch * q_len
    q = torch.randn(tokens, shape.num_q_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    index_q = torch.randn(tokens, shape.num_index_heads, shape.index_head_dim, device="cuda", dtype=torch.bfloat16)
    pb = PagedBatch(
        query_start_loc=torch.arange(0, tokens + 1, q_len, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
        block_table=pages,
    )
    scores = torch.randn(tokens, shape.num_index_heads, blocks, device="cuda")
    selected = reference.topk_blocks(scores, pb.positions, shape)
    return pb, q, index_q, kv, proxy, selected


def decode(bw):
    print("\n## decode (one token per sequence; CUDA-graph times, eager in brackets)\n")
    print("| context | batch | sparse attn us | GB/s | % copy bw | MSA layer us | dense SDPA us | MSA layer vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for context in (8192, 32768, 131072):
        for batch in (1, 8, 32):
            pb, q, index_q, kv, proxy, selected = paged_problem(batch, context, 1)
            sparse = lambda: cute_kernels.sparse_attention(q, kv, pb, selected, SHAPE, 0.088)  # noqa: E731
            layer = lambda: ops.msa_attention(q, index_q, kv, proxy, pb, SHAPE, 0.088)  # noqa: E731
            t_sparse, t_layer = graph_timed(sparse), graph_timed(layer)
            t_layer_eager = timed(layer)
            nbytes = batch * SHAPE.num_index_heads * min(16, context // 128) * 128 * SHAPE.head_dim * 2 * 2
            dq = q.view(batch, 1, 64, 128).transpose(1, 2)
            dk = torch.randn(batch, SHAPE.num_kv_heads, context, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
            name, dense = dense_attention(dq, dk, torch.randn_like(dk))
            t_dense = graph_timed(dense)
            del dk
            print(f"| {context} | {batch} | {t_sparse * 1e6:.1f} | {nbytes / t_sparse / 1e9:.0f} | "
                  f"{100 * nbytes / t_sparse / bw:.0f}% | {t_layer * 1e6:.1f} ({t_layer_eager * 1e6:.0f}) | "
                  f"{t_dense * 1e6:.1f} ({name}) | {t_dense / t_layer:.1f}x |")


def decode_splits(bw):
    """Split-K sweep at 128K x 32: what sparse_attn.num_splits chooses against every split count."""
    from kernels.cute.sparse_attn import SparseAttentionParams, num_splits, resident_ctas_per_sm

    params = SparseAttentionParams(SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.num_index_heads, SHAPE.head_dim)
    resident = resident_ctas_per_sm(params) * torch.cuda.get_device_properties(0).multi_processor_count
    chosen, _ = num_splits(32, params, SHAPE.topk_blocks, resident)
    print(f"\n## decode split-K sweep (128K x 32; {resident} resident CTAs; num_splits picks {chosen})\n")
    print("| splits | sparse attn us | % copy bw |")
    print("|---|---|---|")
    pb, q, _, kv, _, selected = paged_problem(32, 131072, 1)
    nbytes = 32 * SHAPE.num_index_heads * 16 * 128 * SHAPE.head_dim * 2 * 2
    for splits in (1, 2, 3, 4, 6, 8, 16):
        t = graph_timed(lambda: cute_kernels.sparse_attention(q, kv, pb, selected, SHAPE, 0.088, splits=splits))
        print(f"| {splits}{' (chosen)' if splits == chosen else ''} | {t * 1e6:.1f} | {100 * nbytes / t / bw:.0f}% |")


def prefill(flops):
    print("\n## prefill (one sequence, all tokens new)\n")
    print("| tokens | sparse attn ms | TFLOP/s | % matmul | proxy scores ms | TFLOP/s | MSA layer ms | dense SDPA ms "
          "| sparse attn vs dense | MSA layer vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for context in (8192, 32768, 131072):
        pb, q, index_q, kv, proxy, selected = paged_problem(1, context, context)
        t_sparse = timed(lambda: cute_kernels.sparse_attention(q, kv, pb, selected, SHAPE, 0.088), iters=3)
        keys = (selected >= 0).sum().item() * 128 * SHAPE.heads_per_index_head  # upper bound: whole blocks
        fl = 4 * keys * SHAPE.head_dim
        t_proxy = timed(lambda: cute_kernels.proxy_block_scores(index_q, proxy, pb, SHAPE), iters=3)
        blocks = context // 128
        proxy_fl = 2 * SHAPE.num_index_heads * SHAPE.index_head_dim * context * 128 * (blocks + 1) / 2  # visible blocks
        t_layer = timed(lambda: ops.msa_attention(q, index_q, kv, proxy, pb, SHAPE, 0.088), iters=2)
        dq = q.view(1, context, 64, 128).transpose(1, 2)
        dk = torch.randn(1, SHAPE.num_kv_heads, context, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
        name, dense = dense_attention(dq, dk, torch.randn_like(dk))
        t_dense = timed(dense, iters=2)
        print(f"| {context} | {t_sparse * 1e3:.2f} | {fl / t_sparse / 1e12:.0f} | {100 * fl / t_sparse / flops:.0f}% | "
              f"{t_proxy * 1e3:.2f} | {proxy_fl / t_proxy / 1e12:.0f} | {t_layer * 1e3:.2f} | {t_dense * 1e3:.2f} ({name}) | "
              f"{t_dense / t_sparse:.1f}x | {t_dense / t_layer:.1f}x |")


def main():
    t0 = time.time()
    bw, flops = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    decode(bw)
    decode_splits(bw)
    prefill(flops)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
