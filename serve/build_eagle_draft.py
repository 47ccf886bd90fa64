"""Build an EAGLE draft for a FLASH_MSA checkpoint (FlashMSAForCausalLM or MiniMax-M3): vLLM's
EagleLlamaForCausalLM, one Llama decoder layer over [token embedding, the target's last hidden state] (fc), the
target's embedding and LM head shared (left out of the draft). Seeded and untrained: the layer's weights are small
random ones and fc passes the target's hidden state through, so the draft proposes roughly what the target's last
position predicted and few proposals are accepted; what it shows is speculation's plumbing (drafts verified on
FLASH_MSA's decode kernels, greedy tokens unchanged), not its speed-up.

    python3 serve/build_eagle_draft.py TARGET_DIR OUT_DIR [--seed 0]
    vllm serve TARGET_DIR --attention-backend FLASH_MSA \\
        --speculative-config '{"method": "eagle", "model": "OUT_DIR", "num_speculative_tokens": 3}'

On a GPU give the draft a backend of its own (its layers are plain attention, which FLASH_MSA does not run):
add "attention_backend": "FLASH_ATTN" to the speculative config. On CPU vLLM runs the draft on its CPU backend.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HEAD_DIM = 128
COPIED = (
    "vocab_size",
    "hidden_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
)


def draft_config(target: dict) -> dict:
    """The draft's config.json from the target's (a MiniMax-M3 checkpoint's text_config): its vocabulary and hidden
    size, one layer of 128-wide heads."""
    text = {**target, **target.get("text_config", {})}
    hidden = text["hidden_size"]
    head_dim = min(HEAD_DIM, hidden)
    heads = hidden // head_dim
    config = {key: text[key] for key in COPIED if key in text}
    config.update(
        architectures=["EagleLlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    return config


def draft_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """fc [H, 2H] = [0 | I] (the target's hidden state through), layer 0 (no input norm: EAGLE's first layer has none)
    with N(0, 0.02) projections and unit post-attention norm."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "layers.0.self_attn.q_proj.weight": (q_dim, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_dim, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_dim, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, q_dim),
        "layers.0.mlp.gate_proj.weight": (inner, hidden),
        "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
    }
    weights = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    return {name: tensor.to(dtype).contiguous() for name, tensor in weights.items()}


def build(target_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    target = json.loads((target_dir / "config.json").read_text())
    config = draft_config(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(draft_weights(config, seed), str(out_dir / "model.safetensors"))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"EAGLE draft for {args.target_dir} in {build(args.target_dir, args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()
