"""Build the random-weight MSA demo checkpoint that the demo server loads.

Owns the on-disk demo model: a byte-level BPE tokenizer trained locally on the
Python standard library, `config.json` / `generation_config.json` for
`FlashMSAForCausalLM`, and seeded random bf16 weights in `model.safetensors`.
Nothing is downloaded. An existing complete model with the same config is
reused, so calling this at every server start is cheap.

    python serve/build_demo_model.py OUT_DIR [--preset {default,m3-attention,m3-attention-1m}] [--seed N] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Special tokens come first in the trained vocab, so their ids are 0..4.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD, IM_START, IM_END = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAIN_BYTES = 3_000_000  # stdlib text used for BPE training (a few seconds)
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

DEFAULT_CONFIG = {
    "architectures": ["FlashMSAForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": BOS,
    "eos_token_id": [EOS, IM_END],
    "pad_token_id": PAD,
    "attention_bias": False,
    "mlp_bias": False,
    "msa_config": {
        "block_size": 128,
        "topk_blocks": 4,
        "local_blocks": 1,
        "init_blocks": 0,
        "num_index_heads": 4,
        "num_index_key_heads": 1,
        "index_head_dim": 32,
        "dense_layers": [0],
    },
}


# Named variants of DEFAULT_CONFIG (--preset). "m3-attention": MiniMax-M3's attention shapes (Hq 64,
# Hkv 4, D 128, Hi 4, Hki 1, Dp 128, top-16 blocks) in a 4-layer model with a 136K context, so GPU
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


def make_config(**overrides) -> dict:
    """DEFAULT_CONFIG with top-level keys replaced; a dict for "msa_config" is merged."""
    config = json.loads(json.dumps(DEFAULT_CONFIG))  # deep copy
    msa = overrides.pop("msa_config", {})
    unknown = overrides.keys() - config.keys()
    unknown |= {f"msa_config.{k}" for k in msa.keys() - config["msa_config"].keys()}
    if unknown:
        raise TypeError(f"unknown config keys: {', '.join(sorted(unknown))}")
    config.update(overrides)
    config["msa_config"].update(msa)
    return config


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

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "pad_token": SPECIAL_TOKENS[PAD],
        "extra_special_tokens": [SPECIAL_TOKENS[IM_START], SPECIAL_TOKENS[IM_END]],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    log.info("tokenizer: byte-level BPE, %d tokens, trained on %.1f MB of %s", vocab_size, total / 1e6, stdlib)


def write_config(out_dir: Path, config: dict) -> None:
    """Write config.json and a generation_config.json with matching special-token ids."""
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out_dir / "generation_config.json", generation)


def write_weights(out_dir: Path, config: dict, seed: int) -> None:
    """Write seeded random bf16 weights to model.safetensors.

    Linear weights are N(0, 1/fan_in) so activations stay O(1); lm_head uses 2/sqrt(H)
    so greedy logits are well separated; index_q/k use 1/sqrt(H) so block scores vary.
    """
    import torch
    from safetensors.torch import save_file

    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]  # noqa: E741  (the formulas' names)
    Hq, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    msa = config["msa_config"]
    Hi, Hki, Dp = msa["num_index_heads"], msa["num_index_key_heads"], msa["index_head_dim"]

    gen = torch.Generator().manual_seed(seed)
    tensors = {}

    def normal(name, shape, std):
        tensors[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    def linear(name, out_features, in_features):
        normal(f"{name}.weight", (out_features, in_features), 1 / math.sqrt(in_features))

    def ones(name, size):
        tensors[name] = torch.ones(size, dtype=torch.bfloat16)

    normal("model.embed_tokens.weight", (V, H), 1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        ones(f"{p}.input_layernorm.weight", H)
        ones(f"{p}.post_attention_layernorm.weight", H)
        linear(f"{p}.self_attn.q_proj", Hq * D, H)
        linear(f"{p}.self_attn.k_proj", Hkv * D, H)
        linear(f"{p}.self_attn.v_proj", Hkv * D, H)
        linear(f"{p}.self_attn.o_proj", H, Hq * D)
        if i not in msa["dense_layers"]:
            linear(f"{p}.self_attn.index_q_proj", Hi * Dp, H)
            linear(f"{p}.self_attn.index_k_proj", Hki * Dp, H)
            ones(f"{p}.self_attn.index_q_norm.weight", Dp)
            ones(f"{p}.self_attn.index_k_norm.weight", Dp)
        linear(f"{p}.mlp.gate_proj", I, H)
        linear(f"{p}.mlp.up_proj", I, H)
        linear(f"{p}.mlp.down_proj", H, I)
    ones("model.norm.weight", H)
    normal("lm_head.weight", (V, H), 2 / math.sqrt(H))

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    log.info("weights: %d tensors, %.2fM parameters, seed %d", len(tensors), n_params / 1e6, seed)


def is_complete(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def holds_model(out_dir: Path, config: dict) -> bool:
    """out_dir is a complete checkpoint with this config.json."""
    return is_complete(out_dir) and json.loads((out_dir / "config.json").read_text()) == config


def build_demo_model(out_dir, *, seed: int = 0, overwrite: bool = False, **overrides) -> Path:
    """Write the demo checkpoint to out_dir (or reuse a complete one); return its path (see build_checkpoint)."""
    config = make_config(**overrides)

    def write_files(tmp: Path) -> None:
        write_tokenizer(tmp, config)
        write_config(tmp, config)
        write_weights(tmp, config, seed)

    return build_checkpoint(out_dir, config, write_files, overwrite)


def build_checkpoint(out_dir, config: dict, write_files, overwrite: bool) -> Path:
    """Reuse out_dir if it holds a complete model with this config.json, else build it there.

    Raises FileExistsError if out_dir exists but is not an empty directory or a complete model with
    the same config.json, unless overwrite=True (which replaces out_dir entirely). write_files(tmp)
    fills a sibling temporary directory that is then renamed into place, so out_dir is never left
    half-written.
    """
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not overwrite:
        if holds_model(out_dir, config):
            log.info("reused: %s", out_dir)
            return out_dir
        if is_complete(out_dir):
            raise FileExistsError(f"{out_dir} holds a model with a different config.json; use --overwrite")
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and is not empty or a complete model; use --overwrite")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_files(tmp)
        for path in tmp.iterdir():  # mkdtemp and safetensors create private files
            path.chmod(0o644)
        tmp.chmod(0o755)
        if overwrite and out_dir.is_dir():
            shutil.rmtree(out_dir)
        elif overwrite and out_dir.exists():
            out_dir.unlink()
        try:
            tmp.rename(out_dir)  # atomic; replaces an empty directory
        except OSError:
            if not is_complete(out_dir):
                raise
            log.info("reused: %s (built concurrently by another process)", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    log.info("done: %.1f MB in %s", size / 1e6, out_dir)
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


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
