"""Build a tiny random-weight MiniMax-M3 checkpoint in the format vLLM's in-tree M3 loads.

Owns the tiny M3 checkpoints (the tests', the end-to-end benchmark's): `config.json` as MiniMax-M3
ships it (`model_type` minimax_m3_vl with the text backbone in `text_config`, served as
MiniMaxM3SparseForCausalLM), seeded random bf16 weights under M3's checkpoint names, and the demo
model's locally trained BPE tokenizer.

Presets (--preset):

- default (the tests' model): M3's attention is kept where vLLM's kernels fix it (head_dim = index
  dim = 128, 128-token blocks, one shared index key, index heads == KV heads, Hq/Hkv = 16, partial
  RoPE over 64 dims, Gemma norms, first 3 layers dense) and scaled down elsewhere: 2 KV heads, top-4
  blocks so prompts of a few thousand tokens run sparse, hidden 256, 5 layers, 8 experts (MoE on the
  sparse layers, as M3).
- m3-attention (the end-to-end benchmark's model, serve/bench_e2e.py): MiniMax-M3's attention
  shapes wherever they set attention cost (Hq 64, Hkv = index heads 4, D = Dp 128, one index key,
  top-16 of 128-token blocks) and a 136K context (a 128K prompt plus outputs), in 4 layers with
  hidden 1024 and 8 small experts (94M parameters, 190 MB). Layer 0 is dense and layers 1-3 sparse +
  MoE (as the FlashMSA demo preset), so most attention is sparse, as in M3 (57 of 60 layers).

- m3-attention-1m: m3-attention with MiniMax-M3's 1,048,576 positions, for serving 1M-token contexts.
- production: the released MiniMax-M3's shapes (60 layers, 3 dense; hidden 6144; 128 experts),
  with --config-only: config.json alone, for `python -m vllm_msa.sizing`.

    python serve/build_m3_model.py OUT_DIR [--preset NAME] [--seed N] [--mtp N] [--config-only]

(NAME: default, m3-attention, m3-attention-1m, m3-layer-mix, production). --mtp N adds N multi-token-prediction
modules (model.mtp.layers.*, each a sparse-attention MoE layer: what vLLM's `minimax_m3_mtp` speculative method
drafts with; the target model's loader skips them).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a script
from serve.build_demo_model import write_tokenizer
from vllm_msa.checkpoint import BOS, EOS, IM_END, PAD, build_checkpoint, holds_model, write_json

log = logging.getLogger(__name__)


def layer_pattern(num_dense: int, num_layers: int) -> list[int]:
    """M3's per-layer flags: the first num_dense layers dense (attention and MLP), the rest sparse + MoE."""
    return [0] * num_dense + [1] * (num_layers - num_dense)


NUM_LAYERS = 5
DENSE = layer_pattern(3, NUM_LAYERS)

TEXT_CONFIG = {
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 128,
    "dense_intermediate_size": 512,
    "shared_intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "use_gemma_norm": True,
    "attention_output_gate": False,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "routed_scaling_factor": 2.0,
    "num_mtp_modules": 0,
    "moe_layer_freq": DENSE,
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 2,
        "sparse_topk_blocks": 4,
        "sparse_block_size": 128,
        "sparse_disable_index_value": DENSE,
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": DENSE,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": BOS,
    "eos_token_id": [EOS, IM_END],
    "pad_token_id": PAD,
}


M3_ATTENTION_LAYERS = layer_pattern(1, 4)
M3_LAYERS = layer_pattern(3, 60)
# Named variants of TEXT_CONFIG (--preset), as make_config overrides.
PRESETS = {
    "production": {  # the released MiniMax-M3's shapes (~428B parameters): for --config-only (sizing)
        "vocab_size": 200064,
        "hidden_size": 6144,
        "intermediate_size": 3072,
        "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072,
        "num_hidden_layers": len(M3_LAYERS),
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1048576,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "moe_layer_freq": M3_LAYERS,
        "sparse_attention_config": {
            "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16,
            "sparse_disable_index_value": M3_LAYERS,
            "sparse_attention_freq": M3_LAYERS,
        },
    },
    "default": {},
    "m3-attention": {
        "hidden_size": 1024,
        "num_hidden_layers": len(M3_ATTENTION_LAYERS),
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "max_position_embeddings": 139264,
        "moe_layer_freq": M3_ATTENTION_LAYERS,
        "sparse_attention_config": {
            "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16,
            "sparse_disable_index_value": M3_ATTENTION_LAYERS,
            "sparse_attention_freq": M3_ATTENTION_LAYERS,
        },
    },
}
# MiniMax-M3's layer mix (3 dense layers, then 57 MSA ones) with m3-attention's shapes: attention's share of
# a step as in M3, for end-to-end benchmarks (about 1.3B parameters: 2.6 GB in bf16; build it on the GPU machine).
PRESETS["m3-layer-mix"] = {
    **PRESETS["m3-attention"],
    "num_hidden_layers": len(M3_LAYERS),
    "moe_layer_freq": M3_LAYERS,
    "sparse_attention_config": {
        **PRESETS["m3-attention"]["sparse_attention_config"],
        "sparse_disable_index_value": M3_LAYERS,
        "sparse_attention_freq": M3_LAYERS,
    },
}

# m3-attention with MiniMax-M3's own position limit: 1M-token serving (issue 18: --max-model-len 1048576).
PRESETS["m3-attention-1m"] = {**PRESETS["m3-attention"], "max_position_embeddings": 1048576}


def make_config(**text_overrides) -> dict:
    """The top-level config.json; text_overrides replace TEXT_CONFIG keys (a dict for sparse_attention_config is
    merged)."""
    text = json.loads(json.dumps(TEXT_CONFIG))
    sparse = text_overrides.pop("sparse_attention_config", {})
    unknown = (text_overrides.keys() - text.keys()) | (sparse.keys() - text["sparse_attention_config"].keys())
    if unknown:
        raise TypeError(f"unknown config keys: {', '.join(sorted(unknown))}")
    text.update(text_overrides)
    text["sparse_attention_config"].update(sparse)
    return {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "text_config": text,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def checkpoint_tensors(text: dict, seed: int) -> dict:
    """Seeded random weights under M3's checkpoint names: N(0, 1/fan_in) linears, small norm offsets
    (Gemma norms scale by 1 + w), an lm_head of 2/sqrt(H) so greedy logits are well separated."""
    import torch

    H, V, D = text["hidden_size"], text["vocab_size"], text["head_dim"]
    Hq, Hkv, E = text["num_attention_heads"], text["num_key_value_heads"], text["num_local_experts"]
    sparse = text["sparse_attention_config"]
    Hi, Dp = sparse["sparse_num_index_heads"], sparse["sparse_index_dim"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}

    def normal(name, shape, std, dtype=torch.bfloat16):
        tensors[name] = (torch.randn(shape, generator=gen) * std).to(dtype)

    def linear(name, out_features, in_features, dtype=torch.bfloat16):
        normal(f"{name}.weight", (out_features, in_features), 1 / math.sqrt(in_features), dtype)

    def norm(name, size):
        normal(f"{name}.weight", (size,), 0.1)

    def mlp(name, gate, up, down, size):
        linear(f"{name}.{gate}", size, H)
        linear(f"{name}.{up}", size, H)
        linear(f"{name}.{down}", H, size)

    def decoder_layer(p: str, sparse_attention: bool, moe_mlp: bool):
        norm(f"{p}.input_layernorm", H)
        norm(f"{p}.post_attention_layernorm", H)
        linear(f"{p}.self_attn.q_proj", Hq * D, H)
        linear(f"{p}.self_attn.k_proj", Hkv * D, H)
        linear(f"{p}.self_attn.v_proj", Hkv * D, H)
        linear(f"{p}.self_attn.o_proj", H, Hq * D)
        norm(f"{p}.self_attn.q_norm", D)
        norm(f"{p}.self_attn.k_norm", D)
        if sparse_attention:
            linear(f"{p}.self_attn.index_q_proj", Hi * Dp, H)
            linear(f"{p}.self_attn.index_k_proj", Dp, H)
            norm(f"{p}.self_attn.index_q_norm", Dp)
            norm(f"{p}.self_attn.index_k_norm", Dp)
        if moe_mlp:
            moe = f"{p}.block_sparse_moe"
            linear(f"{moe}.gate", E, H, torch.float32)
            normal(f"{moe}.e_score_correction_bias", (E,), 0.01, torch.float32)
            for e in range(E):
                mlp(f"{moe}.experts.{e}", "w1", "w3", "w2", text["intermediate_size"])
            mlp(
                f"{moe}.shared_experts",
                "gate_proj",
                "up_proj",
                "down_proj",
                text["intermediate_size"] * text["n_shared_experts"],
            )
        else:
            mlp(f"{p}.mlp", "gate_proj", "up_proj", "down_proj", text["dense_intermediate_size"])

    normal("model.embed_tokens.weight", (V, H), 1.0)
    for i in range(text["num_hidden_layers"]):
        decoder_layer(f"model.layers.{i}", bool(sparse["sparse_attention_freq"][i]), bool(text["moe_layer_freq"][i]))
    # M3's multi-token-prediction draft modules (vLLM's minimax_m3_mtp): each a sparse-attention MoE layer between
    # norms of the token embedding and of the previous hidden state, joined by eh_proj.
    for m in range(text["num_mtp_modules"]):
        p = f"model.mtp.layers.{m}"
        norm(f"{p}.enorm", H)
        norm(f"{p}.hnorm", H)
        linear(f"{p}.eh_proj", H, 2 * H)
        decoder_layer(f"{p}.transformer_layer", True, True)
        norm(f"{p}.final_layernorm", H)
    norm("model.norm", H)
    normal("lm_head.weight", (V, H), 2 / math.sqrt(H))
    return tensors


def build_m3_model(out_dir, *, seed: int = 0, **text_overrides) -> Path:
    """Write the checkpoint to out_dir (reused when complete with the same config.json); return its path.

    Built in a sibling temporary directory and renamed into place; a different model there is replaced.
    """
    from safetensors.torch import save_file

    config = make_config(**text_overrides)
    text = config["text_config"]

    def write_files(tmp: Path) -> None:
        write_tokenizer(tmp, text)
        write_json(tmp / "config.json", config)
        write_json(
            tmp / "generation_config.json", {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        )
        tensors = checkpoint_tensors(text, seed)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        log.info(
            "weights: %d tensors, %.2fM parameters, seed %d",
            len(tensors),
            sum(t.numel() for t in tensors.values()) / 1e6,
            seed,
        )

    return build_checkpoint(out_dir, config, write_files, overwrite=not holds_model(Path(out_dir).resolve(), config))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="checkpoint directory (created or reused)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help=(
            "model shapes (default: the tests' tiny M3; m3-attention: MiniMax-M3's attention shapes, 1 dense + 3 "
            "MSA layers; m3-attention-1m: the same with M3's 1M positions; m3-layer-mix: the same shapes in M3's 60 "
            "layers, 3 of them dense)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="weight RNG seed (default 0)")
    parser.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="N multi-token-prediction modules (num_mtp_modules; vLLM's speculative method minimax_m3_mtp), default 0",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json alone (e.g. --preset production, for python -m vllm_msa.sizing)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.mtp < 0:
        parser.error(f"--mtp must be 0 or more, got {args.mtp}")
    overrides = {**PRESETS[args.preset], "num_mtp_modules": args.mtp}
    if args.config_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        write_json(args.out_dir / "config.json", make_config(**overrides))
    else:
        build_m3_model(args.out_dir, seed=args.seed, **overrides)
