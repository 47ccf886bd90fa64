"""The benchmark problems every bench/ script shares: MiniMax-M3's layer shape and random paged batches.

M3_SHAPE   one MSA layer of MiniMax-M3 (msa_kernels.shapes)
SCALE      its softmax scale, D^-0.5
CONTEXTS   the context lengths of the tables; DECODE_BATCHES the decode batch sizes
paged_problem  random bf16 caches, queries and a block selection for a batch of (context, new tokens)
               requests, laid out as vLLM lays them out (decode requests first where the batch mixes)
prefill_problem  one sequence whose tokens are all new, with selections whose neighbouring tokens agree
               to a chosen degree (what the prefill attention kernel's cost follows), or a given one;
               mean_union measures that agreement
load_trained_selections  the selections a model trained with MSA makes (training/trained_selections.py)
"""

import torch

from msa_kernels import reference
from msa_kernels.shapes import M3_SHAPE, MSAShape, PagedBatch

SCALE = M3_SHAPE.head_dim**-0.5
CONTEXTS = (8192, 32768, 131072)
DECODE_BATCHES = (1, 8, 32)


def paged_problem(requests: list[tuple[int, int]], shape: MSAShape = M3_SHAPE, seed: int = 0, device: str = "cuda"):
    """Inputs of one MSA layer for requests (context tokens, of which new) on the GPU (or device): the batch, q,
    index_q, the K/V cache [pages, 2, B, Hkv, D], the index-key cache [pages, B, Hki, Dp] and a selection made
    from random block scores (decode cost depends only on how many blocks are picked)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = shape.block_size
    blocks = [-(-context // b) for context, _ in requests]
    pages = torch.randperm(sum(blocks), device=device, generator=g).to(torch.int32)
    table = torch.full((len(requests), max(blocks)), -1, dtype=torch.int32, device=device)
    first = 0
    for r, n in enumerate(blocks):
        table[r, :n] = pages[first : first + n]
        first += n
    q_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    batch = PagedBatch(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)]).to(device),
        seq_lens=torch.tensor([context for context, _ in requests], dtype=torch.int32, device=device),
        block_table=table,
    )
    tokens = batch.num_tokens

    def randn(*size):
        return torch.randn(*size, device=device, generator=g).to(torch.bfloat16)

    kv = reference.kv_planes(randn(sum(blocks), shape.num_kv_heads, b, 2 * shape.head_dim))  # vLLM's layout
    index_cache = randn(sum(blocks), b, shape.num_index_key_heads, shape.index_head_dim)
    q = randn(tokens, shape.num_q_heads, shape.head_dim)
    index_q = randn(tokens, shape.num_index_heads, shape.index_head_dim)
    scores = torch.randn(tokens, shape.num_index_heads, max(blocks), device=device, generator=g)
    selected = reference.topk_blocks(scores, batch.positions, shape)
    return batch, q, index_q, kv, index_cache, selected


def correlated_scores(
    tokens: int, blocks: int, window: int, generator: torch.Generator, shape: MSAShape = M3_SHAPE
) -> torch.Tensor:
    """[tokens, Hi, blocks] fp32 block scores: a moving sum of `window` normal draws along the tokens
    (window 1: every token independent; window w: neighbours' scores correlate as 1 - lag / w)."""
    out = torch.empty(tokens, shape.num_index_heads, blocks, device="cuda")
    for h in range(shape.num_index_heads):
        noise = torch.randn(tokens + window, blocks, device="cuda", generator=generator)
        sums = torch.cumsum(noise, 0)
        out[:, h] = (sums[window:] - sums[:-window]) / window**0.5
        del noise, sums
    return out


def prefill_problem(
    context: int, window: int, seed: int, shape: MSAShape = M3_SHAPE, selected: torch.Tensor | None = None
):
    """One sequence of `context` new tokens on the GPU: the batch, q, the K/V cache and a selection made
    from correlated_scores(window), or `selected` [context, Hi, k] where given (window unused)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = shape.block_size
    blocks = -(-context // b)
    pages = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(1, blocks)
    kv = torch.randn(blocks, shape.num_kv_heads, b, 2 * shape.head_dim, device="cuda", generator=g)
    kv = reference.kv_planes(kv.to(torch.bfloat16))  # vLLM's layout
    q = torch.randn(context, shape.num_q_heads, shape.head_dim, device="cuda", generator=g).to(torch.bfloat16)
    batch = PagedBatch(
        query_start_loc=torch.tensor([0, context], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
        block_table=pages,
    )
    if selected is None:
        selected = reference.topk_blocks(correlated_scores(context, blocks, window, g, shape), batch.positions, shape)
    return batch, q, kv, selected.to("cuda", torch.int32)


def load_trained_selections(path: str, shape: MSAShape = M3_SHAPE) -> dict[int, torch.Tensor]:
    """{context: int32 [context, Hi, k] selection} of training/trained_selections.py's file: the blocks the
    trained pass-key model's index heads rank highest on a prompt of that length (its Hi and the file's k
    must be the shape's)."""
    saved = torch.load(path)
    selections = {int(context): selected.int() for context, selected in saved["contexts"].items()}
    for context, selected in selections.items():
        if tuple(selected.shape) != (context, shape.num_index_heads, shape.topk_blocks):
            raise SystemExit(
                f"{path}: the {context}-token selection is {list(selected.shape)}, not [{context}, "
                f"{shape.num_index_heads}, {shape.topk_blocks}] (rerun training/trained_selections.py with "
                f"--topk {shape.topk_blocks})"
            )
    return selections


def mean_union(selected: torch.Tensor, tokens: int) -> float:
    """Mean number of distinct blocks per (`tokens` consecutive tokens, index head) of a selection [T, Hi, K]."""
    t = selected.shape[0] // tokens * tokens
    groups = selected[:t].view(-1, tokens, *selected.shape[1:]).transpose(1, 2)
    flat = groups.reshape(*groups.shape[:2], -1).sort(-1).values
    distinct = (flat[..., 1:] != flat[..., :-1]) & (flat[..., 1:] >= 0)
    return (distinct.sum(-1) + (flat[..., 0] >= 0)).float().mean().item()
