"""Build the random-weight MSA demo checkpoint that the demo server loads.

Owns the demo model's contents: a byte-level BPE tokenizer trained locally on the Python standard library,
seeded random bf16 weights, and the named shape presets; written in the checkpoint format of
vllm_msa/checkpoint.py (config.json, tensor names, special tokens, the atomic write). Nothing is downloaded.
An existing complete model with the same config is reused, so calling this at every server start is cheap.

    python serve/build_demo_model.py OUT_DIR [--preset {default,m3-attention,m3-attention-1m}] [--seed N] [--overwrite]
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import sysconfig
from pathlib import Path

from vllm_msa.checkpoint import (
    SPECIAL_TOKENS,
    build_checkpoint,
    make_config,
    tokenizer_config,
    weight_shapes,
    write_config,
    write_json,
)

log = logging.getLogger(__name__)

TRAIN_BYTES = 3_000_000  # stdlib text used for BPE training (a few seconds)


# Named variants of the checkpoint format's DEFAULT_CONFIG (--preset). "m3-attention": MiniMax-M3's attention
# shapes (Hq 64, Hkv 4, D 128, Hi 4, Hki 1, Dp 128, top-16 blocks) in a 4-layer model with a 136K context, so GPU
# measurements mean something at M3's per-layer cost (MLPs and vocabulary stay small).
PRESETS = {
    "default": {},
    "m3-attention": {
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 139264,
        "rope_theta": 1000000.0,
        "msa_config": {"topk_blocks": 16, "index_head_dim": 128},
    },
}

# m3-attention with MiniMax-M3's 1,048,576 positions: 1M-token serving (issue 18: --max-model-len 1048576).
PRESETS["m3-attention-1m"] = {**PRESETS["m3-attention"], "max_position_embeddings": 1048576}


def write_tokenizer(out_dir: Path, config: dict) -> None:
    """Train a byte-level BPE on stdlib sources; write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab_size = config["vocab_size"]

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):  # top-level modules only: no site-packages
        if total >= TRAIN_BYTES:
            break
        texts.append(path.read_bytes().decode("utf-8", errors="replace"))
        total += len(texts[-1])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(out_dir / "tokenizer.json"))

    write_json(out_dir / "tokenizer_config.json", tokenizer_config(config))
    log.info("tokenizer: byte-level BPE, %d tokens, trained on %.1f MB of %s", vocab_size, total / 1e6, stdlib)


def write_weights(out_dir: Path, config: dict, seed: int) -> None:
    """Write seeded random bf16 weights to model.safetensors, every tensor of checkpoint.weight_shapes.

    Linear weights are N(0, 1/fan_in) so activations stay O(1); lm_head uses 2/sqrt(H) so greedy logits are well
    separated; norms are ones; the index projections, linear like the rest, make block scores vary.
    """
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    std = {"embedding": lambda shape: 1.0, "linear": lambda shape: 1 / math.sqrt(shape[1])}
    std["lm_head"] = lambda shape: 2 / math.sqrt(shape[1])
    tensors = {}
    for name, (shape, kind) in weight_shapes(config).items():
        if kind == "norm":
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * std[kind](shape)).to(torch.bfloat16)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    log.info("weights: %d tensors, %.2fM parameters, seed %d", len(tensors), n_params / 1e6, seed)


def build_demo_model(out_dir, *, seed: int = 0, overwrite: bool = False, **overrides) -> Path:
    """Write the demo checkpoint to out_dir (or reuse a complete one); return its path (see build_checkpoint)."""
    config = make_config(**overrides)

    def write_files(tmp: Path) -> None:
        write_tokenizer(tmp, config)
        write_config(tmp, config)
        write_weights(tmp, config, seed)

    return build_checkpoint(out_dir, config, write_files, overwrite)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="checkpoint directory (created or reused)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help=(
            "model shapes (default: the small CPU demo; m3-attention: MiniMax-M3's attention shapes; "
            "m3-attention-1m: the same with 1M positions)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="weight RNG seed (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        build_demo_model(args.out_dir, seed=args.seed, overwrite=args.overwrite, **PRESETS[args.preset])
    except OSError as exc:
        sys.exit(f"error: {exc}")
