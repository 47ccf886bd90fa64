"""The block selections a model trained with MSA makes, at MiniMax-M3's top-k, for the kernel benchmarks.

    python -m training.trained_selections MODEL_DIR [--contexts 8192 16384 32768] [--topk 16] [--layer -1]
        [--depth 0.5] [--out runs/trained-selections.pt]

Random block scores make selections no trained index head would (the prefill attention kernel's cost
follows how many blocks neighbouring tokens share: problems.mean_union). This runs the trained checkpoint
(models/needle-msa) on a pass-key prompt of each context with MSA attention on, takes one MSA layer's
index queries and keys as the model computes them (forward hooks on its index norms, then RoPE), scores
every causal block as FLASH_MSA does (msa_model.block_scores) and keeps the top --topk per (token, index
head) with msa_kernels.reference.topk_blocks (own block forced): the trained model's ranking, at the
benchmarks' k. The checkpoint's index heads (Hi 4) are as many as MiniMax-M3's, so each token's [Hi, k]
selection fits M3's shape as it is. Prints, per context, the mean number of distinct blocks per 4-token
tile and index head (the prefill kernel's tile: 16 = neighbours agree fully, 61 = they share only their
own block) beside random scores' (window 1).

--out gets {"contexts": {context: int16 [T, Hi, k] selection}, "topk", "layer", "model", "depth",
"mean_union": {context: float}}; bench/problems.load_trained_selections reads it (the GPU
benchmarks take it with --trained FILE). CPU: a 32K prompt takes a minute or two.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from bench.problems import mean_union
from msa_kernels.reference import topk_blocks
from training.msa_model import apply_rope, block_scores, load_checkpoint, rope_tables
from training.needle_task import PassKeyTask, load_tokenizer, random_key
from vllm_msa.checkpoint import EOS

TILE_TOKENS = 4  # tokens per tile of the prefill attention kernel at M3's shape (64 rows / 16 heads per index head)


def layer_index_inputs(model, input_ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index_q [1, Hi, T, Dp] and index_k [1, Hki, T, Dp] of MSA layer `layer` (an index into the MSA layers)
    in a forward pass with MSA attention, as the layer computes them (RMSNorm'd projections, then RoPE)."""
    attention = [block.self_attn for block in model.model.layers if block.self_attn.sparse][layer]
    captured = {}
    hooks = [
        attention.index_q_norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("q", out)),
        attention.index_k_norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("k", out)),
    ]
    try:
        with torch.no_grad():
            model(input_ids, attention="msa")
    finally:
        for hook in hooks:
            hook.remove()
    dp, num_tokens = attention.shape.index_head_dim, input_ids.shape[1]
    rope = rope_tables(num_tokens, dp, model.config["rope_theta"], input_ids.device)
    return tuple(apply_rope(captured[name], rope).transpose(1, 2) for name in ("q", "k"))


def trained_selection(model, task: PassKeyTask, context: int, depth: float, topk: int, layer: int) -> torch.Tensor:
    """int16 [context, Hi, topk]: the blocks each token's index heads rank highest on a pass-key prompt."""
    rng = np.random.default_rng(context)
    ids = torch.tensor([task.prompt(context, depth, random_key(rng), rng).prompt_ids])
    index_q, index_k = layer_index_inputs(model, ids, layer)
    positions = torch.arange(context)
    with torch.no_grad():
        scores = block_scores(index_q.float(), index_k.float(), model.shape, positions)[0].transpose(0, 1)
    shape = dataclasses.replace(model.shape, topk_blocks=topk)
    return topk_blocks(scores.contiguous(), positions, shape).to(torch.int16)


def random_selection(context: int, shape) -> torch.Tensor:
    """int32 [context, Hi, k]: the shape's top-k of independent normal block scores, for comparison."""
    scores = torch.randn(context, shape.num_index_heads, -(-context // shape.block_size))
    return topk_blocks(scores, torch.arange(context), shape)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a trained FlashMSAForCausalLM checkpoint (models/needle-msa)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--topk", type=int, default=16, help="blocks kept per (token, index head): M3's 16")
    parser.add_argument("--layer", type=int, default=-1, help="which MSA layer (an index into them; -1: the last)")
    parser.add_argument("--depth", type=float, default=0.5, help="where the pass key sits in the prompt")
    parser.add_argument("--out", type=Path, default=Path("runs/trained-selections.pt"))
    args = parser.parse_args(argv)
    model = load_checkpoint(args.model_dir)
    if max(args.contexts) > model.config["max_position_embeddings"]:
        parser.error(
            f"--contexts beyond the checkpoint's max_position_embeddings {model.config['max_position_embeddings']}"
        )
    task = PassKeyTask(load_tokenizer(args.model_dir), EOS)
    result = {"model": str(args.model_dir), "topk": args.topk, "layer": args.layer, "depth": args.depth}
    result["contexts"], result["mean_union"] = {}, {}
    for context in args.contexts:
        start = time.perf_counter()
        selected = trained_selection(model, task, context, args.depth, args.topk, args.layer)
        random_selected = random_selection(context, dataclasses.replace(model.shape, topk_blocks=args.topk))
        result["contexts"][context] = selected
        result["mean_union"][context] = mean_union(selected.int(), TILE_TOKENS)
        print(
            f"{context} tokens: distinct blocks per {TILE_TOKENS}-token tile and index head "
            f"{result['mean_union'][context]:.1f} trained, {mean_union(random_selected, TILE_TOKENS):.1f} random "
            f"(top-{args.topk}; {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
