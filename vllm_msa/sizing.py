"""Sizing: how many tokens of context fit per GPU for an MSA checkpoint, a GPU and a parallel layout.

    python -m vllm_msa.sizing MODEL_DIR [--gpu-memory-gib 141] [--gpu-memory-utilization 0.9]
        [--tensor-parallel-size 8] [--pipeline-parallel-size 1] [--data-parallel-size 1]
        [--enable-expert-parallel] [--weight-dtype bf16|fp8] [--indexer-kv-dtype auto|bf16|fp8]
        [--contexts 131072 1048576]

Per rank (per pipeline stage, layers as vLLM assigns them): K/V and index-key bytes per token of
context, summed over the rank's layers from the very KV
cache specs FLASH_MSA gives vLLM (layer.kv_cache_spec, index_key_cache.index_key_cache_spec, for the rank's
heads from MSAModelConfig.rank_layout), so it cannot drift from what vLLM allocates; the weights the
rank holds (counted from config.json: tensor parallel splits attention and MLP/expert matrices as vLLM's
parallel linears do, expert parallel spreads whole experts over TP x DP ranks, data parallel replicates
the rest); and the context that fits in what is left of the memory vLLM may use. K/V in bf16, index keys
as --indexer-kv-dtype says (auto: the checkpoint's msa_config.indexer_kv_dtype, else bf16; fp8: e4m3 and a
float32 scale per token). Activations, CUDA
graphs and the NCCL buffers also take memory, so treat the fit as an upper bound. FlashMSAForCausalLM
(msa_config) and MiniMax-M3 (sparse_attention_config, as vLLM reads it) checkpoints.
"""

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_msa import compat
from vllm_msa.config import SERVED_INDEXER_KV_DTYPES, MSAModelConfig, index_key_dtype
from vllm_msa.index_key_cache import index_key_cache_spec
from vllm_msa.layer import kv_cache_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False

    def describe(self) -> str:
        ep = f" + EP {self.tp * self.dp}" if self.expert_parallel else ""
        return f"TP {self.tp} x PP {self.pp} x DP {self.dp}{ep} ({self.tp * self.pp * self.dp} GPUs)"


def load(model_dir: Path) -> tuple["PretrainedConfig", MSAModelConfig, bool]:
    """(text config as vLLM reads it, MSAModelConfig, is MiniMax-M3)."""
    config = compat.load_hf_config(str(model_dir))
    text = config.get_text_config()
    if hasattr(text, "msa_config"):
        return text, MSAModelConfig.from_hf_config(text), False
    return text, MSAModelConfig.from_minimax_m3(text), True


def cache_bytes_per_token(
    text: "PretrainedConfig", msa: MSAModelConfig, layers: range, tp: int, indexer_kv_dtype: str = "auto"
) -> tuple[int, int]:
    """(K/V, index keys) bytes per context token of one rank holding these layers (its TP rank 0); indexer_kv_dtype
    auto: the checkpoint's."""
    dtype = torch.bfloat16
    keys = index_key_dtype(msa.indexer_kv_dtype if indexer_kv_dtype == "auto" else indexer_kv_dtype, dtype)
    layout = msa.rank_layout(text, tp, 0)
    shape = layout.shape
    kv = index_keys = 0
    for layer in layers:
        kv += kv_cache_spec(shape, dtype).page_size_bytes // shape.block_size
        if msa.is_sparse(layer):
            spec = index_key_cache_spec(shape.num_index_key_heads, shape.index_head_dim, shape.block_size, keys)
            index_keys += spec.page_size_bytes // shape.block_size
    return kv, index_keys


def weight_bytes(
    text: "PretrainedConfig",
    msa: MSAModelConfig,
    layers: range,
    layout: Layout,
    m3: bool,
    weight_bytes_per: int,
    first_stage: bool,
    last_stage: bool,
) -> int:
    """Bytes of the weights one rank holds: linear layers at weight_bytes_per per parameter, the rest bf16
    (embeddings on the first pipeline stage, the LM head on the last, both split over TP)."""
    h, tp = text.hidden_size, layout.tp
    shape = msa.layer_shape(text)
    d, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
    kv_per_rank = max(1, hkv // tp)
    index_heads = msa.rank_layout(text, tp, 0).shape.num_index_heads if m3 else shape.num_index_heads  # vLLM's M3
    # splits its fused index projection as KV heads; FlashMSAForCausalLM replicates it
    moe_layers = compat.m3_moe_layers(text) if m3 else []
    linear = 0.0  # parameters of linear layers on this rank
    other = 0.0  # norms, embeddings, router: bf16
    for layer in layers:
        linear += h * (hq // tp) * d * 2 + h * kv_per_rank * d * 2  # q and o; k and v
        other += 2 * h
        if msa.is_sparse(layer):
            linear += h * (index_heads + shape.num_index_key_heads) * shape.index_head_dim
            other += 2 * shape.index_head_dim
        if not m3:
            linear += 3 * h * text.intermediate_size / tp
        elif not moe_layers[layer]:
            linear += 3 * h * text.dense_intermediate_size / tp
        else:
            experts = text.num_local_experts
            expert = 3 * h * text.intermediate_size
            if layout.expert_parallel:
                linear += expert * math.ceil(experts / (tp * layout.dp))
            else:
                linear += expert * experts / tp
            linear += 3 * h * text.shared_intermediate_size * getattr(text, "n_shared_experts", 1) / tp
            other += h * experts
    vocab = text.vocab_size * h / tp
    other += vocab * (first_stage + (last_stage and not getattr(text, "tie_word_embeddings", False)))
    return int(linear * weight_bytes_per + other * 2)


def size(
    model_dir: Path,
    layout: Layout,
    gpu_gib: float,
    utilization: float,
    weight_dtype: str,
    contexts: list[int],
    indexer_kv_dtype: str = "auto",
) -> str:
    text, msa, m3 = load(model_dir)
    msa.rank_layout(text, layout.tp, 0)  # refuses a split FLASH_MSA cannot serve, naming the sizes
    per = {"bf16": 2, "fp8": 1}[weight_dtype]
    keys = msa.indexer_kv_dtype if indexer_kv_dtype == "auto" else indexer_kv_dtype
    lines = [
        f"{model_dir.name}: {text.num_hidden_layers} layers ({len(msa.sparse_layers(text.num_hidden_layers))} MSA), "
        f"{layout.describe()}, {weight_dtype} weights, bf16 K/V, {'bf16' if keys == 'auto' else keys} index keys, "
        f"{gpu_gib:g} GiB x {utilization:g}",
        f"heads {msa.rank_layout(text, layout.tp, 0).describe(layout.tp)}",
        "| stage | layers | K/V B/token | index keys B/token | weights GiB | cache GiB | tokens that fit | "
        + " | ".join(f"sequences of {c}" for c in contexts)
        + " |",
        "|---" * (6 + len(contexts)) + "|---|",
    ]
    for stage, layers in enumerate(compat.pipeline_layers(text.num_hidden_layers, layout.pp)):
        kv, index_keys = cache_bytes_per_token(text, msa, layers, layout.tp, keys)
        weights = weight_bytes(text, msa, layers, layout, m3, per, stage == 0, stage == layout.pp - 1)
        cache = gpu_gib * GIB * utilization - weights
        tokens = max(0, int(cache // (kv + index_keys)))
        fits = [f"{tokens / c:.1f}" for c in contexts]
        lines.append(
            f"| {stage} | {layers.start}-{layers.stop - 1} | {kv} | {index_keys} | {weights / GIB:.1f} | "
            f"{max(cache, 0) / GIB:.1f} | {tokens} | " + " | ".join(fits) + " |"
        )
    if m3 and (layout.tp > 1 or layout.pp > 1):
        lines.append(
            "(FLASH_MSA accepts MiniMax-M3 at these sizes but has run it at tensor and pipeline parallel size 1 "
            "only: these are the sizes the head-split rules give)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--gpu-memory-gib", type=float, default=141.0, help="memory of one GPU (H200: 141)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of it (0.9)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--indexer-kv-dtype", choices=SERVED_INDEXER_KV_DTYPES, default="auto")
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    args = parser.parse_args()
    if min(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) < 1:
        parser.error("parallel sizes must be >= 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} has no config.json")
    layout = Layout(
        args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size, args.enable_expert_parallel
    )
    print(
        size(
            args.model_dir,
            layout,
            args.gpu_memory_gib,
            args.gpu_memory_utilization,
            args.weight_dtype,
            args.contexts,
            args.indexer_kv_dtype,
        )
    )


if __name__ == "__main__":
    main()
