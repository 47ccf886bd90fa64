"""FlashMSAForCausalLM as a trainable PyTorch module: the served checkpoint's weight names and math.

Owns the training side of the model format that `vllm_msa/models/flash_msa.py` serves and
`tests/reference_model.py` checks outside vLLM: a Llama (RMSNorm, neox RoPE, GQA, SwiGLU MLP, untied
lm_head) whose MSA layers (all but msa_config.dense_layers) carry the index branch
    index_q = RoPE(RMSNorm(index_q_proj x))  [Hi, Dp]      index_k = RoPE(RMSNorm(index_k_proj x))  [Hki, Dp]
with the state_dict names of the checkpoint, and the export to / load from a checkpoint directory.

Each forward call picks the attention of the MSA layers (dense layers are always dense):
  "dense"  causal attention over every key (torch's SDPA);
  "msa"    each index head scores every causal block (max over the block's keys of index_q . index_k),
           msa_kernels.reference.topk_blocks keeps the top-k per (token, index head) with the own block
           forced, and query head g (of index head g // (Hq / Hi)) attends with an exact softmax to the
           selected blocks' causal keys only: the selection is what FLASH_MSA serves; gradients reach
           q, k and v, not the discrete selection.
distill=True adds the index-distillation loss of every MSA layer (Flash-MSA's way of training the
index heads): the target is the dense attention's probability mass per key block, summed over the
index head's query heads and over the block's tokens (divided by Hq / Hi, so it sums to 1 over the
causal blocks) and detached; the index distribution is the softmax over the causal blocks of the
max-pooled block scores times Dp^-0.5; the loss is KL(target || index), averaged over the sequences and
index heads, over two sets of queries past the first block (whose tokens have one causal block only):
  strided  every DISTILL_QUERY_STRIDE-th token, the last one included: the stride keeps the target's
           dense-attention pass a fraction of a training step;
  focus    every token of the span where retrieval happens (`distill_focus`, [start, end) positions: in
           pass-key training the question and the answer; by default the last DISTILL_FOCUS_TOKENS tokens).
The two sets' means are weighted 1 - DISTILL_FOCUS_WEIGHT and DISTILL_FOCUS_WEIGHT. Why: the strided
queries are thousands of filler tokens whose attention is local (mostly their own block, selected
anyway), while the ~20 question and answer tokens are the ones that must find the key's far block:
read at the stride only, ~2 of ~2,000 queries at 16K were such tokens, and a loss that hardly counted
them let the index heads rank the key's block low (phase 2 of the first H200 run: MSA accuracy
0.91/0.69/0.81/0.22 at 2K-16K while dense read the key). Weighted, they are half the loss for ~2% of
its queries: the cost stays the strided pass's. Its gradient reaches only the index projections and
norms: the index branch reads a detached copy of its input.

Memory: every [query chunk x keys] tile holds at most TILE_ELEMENTS scores; the MSA attention and the
index scores recompute their chunks in the backward pass (activation checkpointing), so 16K-token
contexts train on one GPU. Runs on CPU (float32) and CUDA (under bf16 autocast: selection and norms in
float32).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from msa_kernels.reference import topk_blocks
from msa_kernels.shapes import MSAShape
from vllm_msa.checkpoint import build_checkpoint, write_config

TILE_ELEMENTS = 1 << 28
ATTENTION_MODES = ("dense", "msa")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MASKED_SCORE = -1e30  # an invisible block's index score: finite, so 0 x log(0) terms stay 0
DISTILL_QUERY_STRIDE = 8  # the distillation loss reads every 8th query: its target costs a dense attention pass
DISTILL_FOCUS_TOKENS = 32  # the default focus span of the distillation: the last 32 queries
DISTILL_FOCUS_WEIGHT = 0.5  # the focus span's share of the distillation loss (the strided queries' the rest)


def layer_shape(config: dict) -> MSAShape:
    """The MSA layer shape of a FlashMSAForCausalLM config.json (as vllm_msa.config reads it)."""
    msa = config["msa_config"]
    return MSAShape(
        num_q_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        num_index_heads=msa["num_index_heads"],
        num_index_key_heads=msa["num_index_key_heads"],
        index_head_dim=msa["index_head_dim"],
        topk_blocks=msa["topk_blocks"],
        local_blocks=msa["local_blocks"],
        init_blocks=msa["init_blocks"],
        block_size=msa["block_size"],
    )


# --------------------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(num_tokens: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, dim/2] of neox RoPE at positions 0..T-1 (angles in float64, as the reference)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    angles = torch.arange(num_tokens, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :].float(), angles.sin()[:, None, :].float()


def apply_rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Neox RoPE over the last dim of x [B, T, H, d]."""
    cos, sin = table
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def query_chunks(num_queries: int, elements_per_query: int):
    """[start, end) query ranges whose tiles hold at most TILE_ELEMENTS elements; whole 128-query multiples
    where that fits (aligned masks)."""
    step = max(1, TILE_ELEMENTS // max(1, elements_per_query))
    step -= step % 128 if step >= 128 else 0
    for start in range(0, num_queries, step):
        yield start, min(num_queries, start + step)


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[queries, num_keys] True where key j is visible to the query at position p (j <= p)."""
    return torch.arange(num_keys, device=positions.device)[None, :] <= positions[:, None]


def repeat_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, h, T, d] -> [B, num_heads, T, d], head g from head g // (num_heads / h)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def padded_keys(k: torch.Tensor, num_heads: int, block_size: int) -> torch.Tensor:
    """k [B, h, T, d] repeated to num_heads heads and zero-padded to whole blocks (never visible: causal)."""
    num_tokens = k.shape[2]
    return F.pad(repeat_heads(k, num_heads), (0, 0, 0, -(-num_tokens // block_size) * block_size - num_tokens))


# --------------------------------------------------------------------------------------------- MSA math
# Queries are given with their positions (ascending; on the host too, so that a chunk's last visible block
# is known without a device sync): all tokens for attention and selection, every DISTILL_QUERY_STRIDE-th
# for the distillation loss.


def _chunk_block_scores(
    index_q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, end: int, block_size: int
) -> torch.Tensor:
    """Max-pooled causal scores [B, Hi, c, blocks up to position end - 1] of queries at `positions`."""
    num_blocks = -(-end // block_size)
    scores = index_q @ keys[:, :, : num_blocks * block_size].transpose(-1, -2)
    scores = scores.masked_fill(~causal_mask(positions, scores.shape[-1]), float("-inf"))
    return scores.view(*scores.shape[:-1], num_blocks, block_size).amax(-1)


def block_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, shape: MSAShape, positions: torch.Tensor
) -> torch.Tensor:
    """Max-pooled causal index scores [B, Hi, Q, blocks]; -inf where a block holds no visible key.

    index_q [B, Hi, Q, Dp] at `positions` (host tensor [Q]), index_k [B, Hki, T, Dp]. With autograd on, each
    query chunk is recomputed in the backward pass rather than kept.
    """
    batch, heads = index_q.shape[:2]
    keys = padded_keys(index_k, heads, shape.block_size)
    num_blocks = keys.shape[2] // shape.block_size
    on_device = positions.to(index_q.device)
    chunks = []
    for start, end in query_chunks(len(positions), batch * heads * keys.shape[2]):
        args = (index_q[:, :, start:end], keys, on_device[start:end], int(positions[end - 1]) + 1, shape.block_size)
        if torch.is_grad_enabled():
            chunk = checkpoint(_chunk_block_scores, *args, use_reentrant=False)
        else:
            chunk = _chunk_block_scores(*args)
        chunks.append(F.pad(chunk, (0, num_blocks - chunk.shape[-1]), value=float("-inf")))
    return torch.cat(chunks, dim=2)


@torch.no_grad()
def select_blocks(index_q: torch.Tensor, index_k: torch.Tensor, shape: MSAShape) -> torch.Tensor:
    """The blocks each (token, index head) attends to, as a mask [B, Hi, T, blocks] (float32 scores,
    msa_kernels.reference.topk_blocks: top-k with the local and init blocks forced)."""
    batch, heads, num_tokens = index_q.shape[:3]
    with torch.autocast(index_q.device.type, enabled=False):
        scores = block_scores(index_q.float(), index_k.float(), shape, torch.arange(num_tokens))
    num_blocks = scores.shape[-1]
    positions = torch.arange(num_tokens, device=scores.device).repeat(batch)
    chosen = topk_blocks(scores.transpose(1, 2).reshape(batch * num_tokens, heads, num_blocks), positions, shape)
    chosen = chosen.long()
    mask = torch.zeros(batch * num_tokens, heads, num_blocks + 1, dtype=torch.bool, device=scores.device)
    mask.scatter_(2, chosen.masked_fill(chosen < 0, num_blocks), True)
    return mask[..., :num_blocks].view(batch, num_tokens, heads, num_blocks).transpose(1, 2)


def _chunk_sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    selected: torch.Tensor,
    positions: torch.Tensor,
    end: int,
    block_size: int,
) -> torch.Tensor:
    """SDPA of queries at positions ..end-1 over the causal keys of their selected blocks ([B, Hq, c, blocks])."""
    token_mask = selected.repeat_interleave(block_size, dim=-1)[..., :end] & causal_mask(positions, end)
    return F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=token_mask)


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, shape: MSAShape
) -> torch.Tensor:
    """Exact-softmax causal attention of q [B, Hq, T, D] over the selected blocks ([B, Hi, T, blocks]) of
    k, v [B, Hkv, T, D]; query head g reads index head g // (Hq / Hi)'s blocks. [B, Hq, T, D]."""
    batch, heads, num_tokens, _ = q.shape
    keys, values = repeat_heads(k, heads), repeat_heads(v, heads)
    selected = repeat_heads(selected, heads)
    positions = torch.arange(num_tokens, device=q.device)
    out = []
    for start, end in query_chunks(num_tokens, batch * heads * num_tokens):
        chunk_selected = selected[:, :, start:end, : -(-end // shape.block_size)]
        args = (q[:, :, start:end], keys, values, chunk_selected, positions[start:end], end, shape.block_size)
        if torch.is_grad_enabled():
            out.append(checkpoint(_chunk_sparse_attention, *args, use_reentrant=False))
        else:
            out.append(_chunk_sparse_attention(*args))
    return torch.cat(out, dim=2)


@torch.no_grad()
def dense_block_mass(q: torch.Tensor, k: torch.Tensor, shape: MSAShape, positions: torch.Tensor) -> torch.Tensor:
    """Dense causal attention's probability mass per key block for the queries q [B, Hq, Q, D] at `positions`
    (host tensor [Q]) over k [B, Hkv, T, D], summed over each index head's query heads and divided by their
    number: [B, Hi, Q, blocks], summing to 1 over blocks."""
    batch, heads, _, head_dim = q.shape
    index_heads, block_size = shape.num_index_heads, shape.block_size
    keys = padded_keys(k, heads, block_size)
    num_blocks, group = keys.shape[2] // block_size, heads // index_heads
    on_device = positions.to(q.device)
    chunks = []
    for start, end in query_chunks(len(positions), batch * heads * keys.shape[2]):
        chunk_blocks = -(-(int(positions[end - 1]) + 1) // block_size)
        scores = q[:, :, start:end] @ keys[:, :, : chunk_blocks * block_size].transpose(-1, -2)
        scores = scores.masked_fill_(~causal_mask(on_device[start:end], scores.shape[-1]), float("-inf"))
        probs = (scores * head_dim**-0.5).softmax(-1, dtype=torch.float32)
        probs = probs.view(batch, index_heads, group, end - start, chunk_blocks, block_size)
        chunks.append(F.pad(probs.sum((2, 5)) / group, (0, num_blocks - chunk_blocks)))
    return torch.cat(chunks, dim=2)


def distillation_queries(
    num_tokens: int, block_size: int, focus: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distillation's query positions (ascending, host tensor) and which of them are the focus span's:
    every DISTILL_QUERY_STRIDE-th past the first block, the last one included, and every one of the focus
    span [start, end) past the first block (default: the last DISTILL_FOCUS_TOKENS)."""
    start, end = focus if focus is not None else (num_tokens - DISTILL_FOCUS_TOKENS, num_tokens)
    start, end = max(start, block_size), min(end, num_tokens)
    focused = torch.arange(start, max(start, end))
    strided = torch.arange(num_tokens - 1, block_size - 1, -DISTILL_QUERY_STRIDE).flip(0)
    strided = strided[(strided < start) | (strided >= end)]
    positions, order = torch.cat([strided, focused]).sort()
    is_focus = torch.cat([torch.zeros(len(strided), dtype=torch.bool), torch.ones(len(focused), dtype=torch.bool)])
    return positions, is_focus[order]


def index_distillation_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    shape: MSAShape,
    focus: tuple[int, int] | None = None,
) -> torch.Tensor:
    """KL(dense block mass || softmax of the index's block scores x Dp^-0.5) of one MSA layer (see the
    module docstring): the strided queries' mean and the focus span's, weighted by DISTILL_FOCUS_WEIGHT;
    gradients reach index_q and index_k only."""
    num_tokens = q.shape[2]
    positions, is_focus = distillation_queries(num_tokens, shape.block_size, focus)
    if len(positions) == 0:
        return q.new_zeros((), dtype=torch.float32)
    on_device = positions.to(q.device)
    target = dense_block_mass(q.detach()[:, :, on_device], k.detach(), shape, positions)
    scores = block_scores(index_q[:, :, on_device], index_k, shape, positions).float()
    num_blocks = scores.shape[-1]
    visible = torch.arange(num_blocks, device=q.device)[None, :] <= (on_device // shape.block_size)[:, None]
    log_index = (scores * shape.index_head_dim**-0.5).masked_fill(~visible, MASKED_SCORE).log_softmax(-1)
    per_query = (torch.special.xlogy(target, target) - target * log_index).sum(-1).mean((0, 1))  # [Q]
    if is_focus.all() or not is_focus.any():
        return per_query.mean()
    weights = torch.where(
        is_focus, DISTILL_FOCUS_WEIGHT / is_focus.sum(), (1 - DISTILL_FOCUS_WEIGHT) / (~is_focus).sum()
    )
    return (per_query * weights.to(per_query.device)).sum()


# ------------------------------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, config: dict, shape: MSAShape, sparse: bool) -> None:
        super().__init__()
        hidden, d, dp = config["hidden_size"], shape.head_dim, shape.index_head_dim
        self.shape, self.sparse = shape, sparse
        self.q_proj = nn.Linear(hidden, shape.num_q_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_q_heads * d, hidden, bias=False)
        if sparse:
            self.index_q_proj = nn.Linear(hidden, shape.num_index_heads * dp, bias=False)
            self.index_k_proj = nn.Linear(hidden, shape.num_index_key_heads * dp, bias=False)
            self.index_q_norm = RMSNorm(dp, config["rms_norm_eps"])
            self.index_k_norm = RMSNorm(dp, config["rms_norm_eps"])

    def _heads(self, x: torch.Tensor, proj: nn.Linear, dim: int) -> torch.Tensor:
        return proj(x).view(*x.shape[:2], -1, dim)  # [B, T, heads, dim]

    def forward(
        self, x: torch.Tensor, rope: dict[int, tuple], attention: str, distill: bool, focus: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s, d, dp = self.shape, self.shape.head_dim, self.shape.index_head_dim
        q = apply_rope(self._heads(x, self.q_proj, d), rope[d]).transpose(1, 2)
        k = apply_rope(self._heads(x, self.k_proj, d), rope[d]).transpose(1, 2)
        v = self._heads(x, self.v_proj, d).transpose(1, 2)
        if self.sparse and (attention == "msa" or distill):
            index_input = x.detach()  # the distillation loss trains the index branch, not what feeds it
            index_q = self.index_q_norm(self._heads(index_input, self.index_q_proj, dp))
            index_k = self.index_k_norm(self._heads(index_input, self.index_k_proj, dp))
            index_q, index_k = (
                apply_rope(index_q, rope[dp]).transpose(1, 2),
                apply_rope(index_k, rope[dp]).transpose(1, 2),
            )
        if self.sparse and attention == "msa":
            out = sparse_attention(q, k, v, select_blocks(index_q, index_k, s), s)
        else:
            heads = s.num_q_heads
            out = F.scaled_dot_product_attention(q, repeat_heads(k, heads), repeat_heads(v, heads), is_causal=True)
        kl = index_distillation_loss(q, k, index_q, index_k, s, focus) if self.sparse and distill else None
        return self.o_proj(out.transpose(1, 2).flatten(2)), kl


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, shape: MSAShape, sparse: bool) -> None:
        super().__init__()
        eps = config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = Attention(config, shape, sparse)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = MLP(config["hidden_size"], config["intermediate_size"])

    def forward(self, x, rope, attention, distill, focus):
        attended, kl = self.self_attn(self.input_layernorm(x), rope, attention, distill, focus)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), kl


class Backbone(nn.Module):
    def __init__(self, config: dict, shape: MSAShape) -> None:
        super().__init__()
        dense = set(config["msa_config"]["dense_layers"])
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            DecoderLayer(config, shape, sparse=i not in dense) for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class FlashMSAForCausalLM(nn.Module):
    """The checkpoint's model; state_dict() names are the checkpoint's (model.layers.N.self_attn.q_proj.weight, ...)."""

    def __init__(self, config: dict, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.shape = layer_shape(config)
        self.model = Backbone(config, self.shape)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """N(0, 0.02) embeddings and projections, output projections scaled down by sqrt(2 x layers)."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config["num_hidden_layers"])
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def index_parameters(self) -> list[nn.Parameter]:
        """The index branch's weights (index_{q,k}_proj, index_{q,k}_norm) of every MSA layer."""
        return [p for name, p in self.named_parameters() if ".index_" in name]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention: str = "dense",
        distill: bool = False,
        distill_focus: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] of input_ids [B, T], and the mean index-distillation loss over the MSA
        layers when distill (else None); distill_focus: the [start, end) positions whose every query the
        distillation reads (default: the last DISTILL_FOCUS_TOKENS)."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention {attention!r} is not one of {ATTENTION_MODES}")
        theta, num_tokens = self.config["rope_theta"], input_ids.shape[1]
        dims = {self.shape.head_dim, self.shape.index_head_dim}
        rope = {d: rope_tables(num_tokens, d, theta, input_ids.device) for d in dims}
        x = self.model.embed_tokens(input_ids).float()
        losses = []
        for layer in self.model.layers:
            x, kl = layer(x, rope, attention, distill, distill_focus)
            if kl is not None:
                losses.append(kl)
        logits = self.lm_head(self.model.norm(x))
        return logits, torch.stack(losses).mean() if losses else None


# ---------------------------------------------------------------------------------------- checkpoints


def export_checkpoint(model: FlashMSAForCausalLM, tokenizer_dir: str | Path, out_dir: str | Path) -> Path:
    """Write model as a checkpoint directory FlashMSAForCausalLM serves: config.json, generation_config.json,
    model.safetensors (bf16) and the tokenizer files of tokenizer_dir (model_max_length raised to the
    config's max_position_embeddings). Replaces out_dir atomically."""
    from safetensors.torch import save_file

    config = model.config

    def write_files(tmp: Path) -> None:
        write_config(tmp, config)
        weights = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(Path(tokenizer_dir) / "tokenizer.json", tmp / "tokenizer.json")
        tokenizer_config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    return build_checkpoint(out_dir, config, write_files, overwrite=True)


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> FlashMSAForCausalLM:
    """A checkpoint directory's model (config.json + model.safetensors), its weights in dtype."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    model = FlashMSAForCausalLM(json.loads((model_dir / "config.json").read_text()))
    weights = load_file(str(model_dir / "model.safetensors"))
    model.load_state_dict({name: t.to(dtype) for name, t in weights.items()})
    return model.to(dtype)
