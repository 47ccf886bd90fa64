"""The on-disk format of the checkpoints vllm-msa builds: the demo, the pass-key model, the test and benchmark models.

Owns what a FlashMSAForCausalLM checkpoint of this project holds and how it is written:
    special tokens      SPECIAL_TOKENS, their ids (BOS, EOS, PAD, IM_START, IM_END: the first ids of the
                        vocabulary) and the ChatML CHAT_TEMPLATE; tokenizer_config(config)
    config.json         DEFAULT_CONFIG (the demo's shapes) and make_config(**overrides), its msa_config block
                        as vllm_msa.config reads it; write_config (with generation_config.json)
    weights             weight_shapes(config): every tensor's checkpoint name (HF Llama plus the MSA layers'
                        index branch), shape and kind, as FlashMSAForCausalLM loads them
    a checkpoint folder build_checkpoint: written into a sibling temporary folder and renamed into place, reused
                        when it already holds a complete model with the same config.json
serve/build_demo_model.py (the demo's tokenizer and random weights), serve/build_m3_model.py (MiniMax-M3's format,
which reuses the special tokens and build_checkpoint) and training/ (the pass-key model's export) write through it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# Special tokens come first in the vocabulary, so their ids are 0..4.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD, IM_START, IM_END = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
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


def tokenizer_config(config: dict) -> dict:
    """tokenizer_config.json of a checkpoint with this config.json: the special tokens and the chat template."""
    return {
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


def weight_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a FlashMSAForCausalLM checkpoint with this config.json: name -> (shape, kind), kind one of
    "embedding", "linear" ([out, in]), "norm" (an RMSNorm weight), "lm_head". MSA layers (those not in
    msa_config.dense_layers) add the index branch: index_{q,k}_proj and index_{q,k}_norm."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]  # noqa: E741  (the formulas' names)
    Hq, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    msa = config["msa_config"]
    Hi, Hki, Dp = msa["num_index_heads"], msa["num_index_key_heads"], msa["index_head_dim"]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((V, H), "embedding")}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layer = {
            f"{p}.input_layernorm.weight": ((H,), "norm"),
            f"{p}.post_attention_layernorm.weight": ((H,), "norm"),
            f"{p}.self_attn.q_proj.weight": ((Hq * D, H), "linear"),
            f"{p}.self_attn.k_proj.weight": ((Hkv * D, H), "linear"),
            f"{p}.self_attn.v_proj.weight": ((Hkv * D, H), "linear"),
            f"{p}.self_attn.o_proj.weight": ((H, Hq * D), "linear"),
        }
        if i not in msa["dense_layers"]:
            layer |= {
                f"{p}.self_attn.index_q_proj.weight": ((Hi * Dp, H), "linear"),
                f"{p}.self_attn.index_k_proj.weight": ((Hki * Dp, H), "linear"),
                f"{p}.self_attn.index_q_norm.weight": ((Dp,), "norm"),
                f"{p}.self_attn.index_k_norm.weight": ((Dp,), "norm"),
            }
        layer |= {
            f"{p}.mlp.gate_proj.weight": ((I, H), "linear"),
            f"{p}.mlp.up_proj.weight": ((I, H), "linear"),
            f"{p}.mlp.down_proj.weight": ((H, I), "linear"),
        }
        shapes |= layer
    shapes |= {"model.norm.weight": ((H,), "norm"), "lm_head.weight": ((V, H), "lm_head")}
    return shapes


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_config(out_dir: Path, config: dict) -> None:
    """Write config.json and a generation_config.json with matching special-token ids."""
    write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    write_json(out_dir / "generation_config.json", generation)


def is_complete(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def holds_model(out_dir: Path, config: dict) -> bool:
    """out_dir is a complete checkpoint with this config.json."""
    return is_complete(out_dir) and json.loads((out_dir / "config.json").read_text()) == config


def build_checkpoint(out_dir, config: dict, write_files: Callable[[Path], None], overwrite: bool) -> Path:
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
