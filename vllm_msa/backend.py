"""The FLASH_MSA attention backend for vLLM: backend class, per-step metadata and its builder, MSA layers' impl.

Data flow of one step: vLLM's scheduler fills CommonAttentionMetadata -> FlashMSAMetadataBuilder
turns it into the step's plan (msa_kernels.plan.StepPlan: a PagedBatch of varlen queries, seq lens and block
table, split once into its decode and prefill parts, each with its workspace) -> for every MSA layer,
MSAImpl writes the new K/V and index keys into their paged caches, scores the index keys per
128-token block, picks the top-k blocks and runs attention over those blocks only (msa_kernels.ops:
CuTeDSL kernels where they serve the inputs, the PyTorch reference otherwise).

MSAImpl runs an MSA layer in three stages with their own signatures (the index query and keys, the index-key
cache), so it has vLLM's base class for impls without the dense forward; MSAAttention (layer.py) builds it and runs
the stages. FLASH_MSA runs MSA layers only: a model's plain (dense) attention layers are vLLM's own, on the
platform's backend (vLLM's FlashAttention on CUDA, its CPU attention on CPU; compat.plain_layers_on_platform_backend,
as vLLM's own MiniMax-M3 runs its dense layers beside its sparse backend), and FlashMSAImpl, what vLLM would build
for a plain layer routed to FLASH_MSA (a model without MSA layers), refuses it by name.

CUDA graphs: where the CuTeDSL kernels serve every FLASH_MSA layer, a step is free of host syncs
and data-dependent shapes (K/V writes through vLLM's reshape_and_cache_flash, index keys through the
CuTeDSL write kernel, device-side token positions, fixed-size selections), so the builder offers
full graphs for uniform decode batches (vLLM's UNIFORM_BATCH: one new token per request, or under
speculative decoding the same 1 + num_speculative_tokens per request); other batches run the layers
eagerly between piecewise graphs.

K/V cache page layout: vLLM's own, as its FlashAttention and MiniMax-M3 backends hold it: [num_pages, num_kv_heads,
block_size, 2 * head_dim] (a head's K and V of a token side by side), page size == MSA block; the kernels read it
through reference.kv_planes' view [num_pages, 2, block_size, num_kv_heads, head_dim].
"""

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionImplBase,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheSpec

from msa_kernels import ops, reference
from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.plan import StepPlan
from msa_kernels.shapes import SINGLE_TOKEN_DECODE_QUERY_LEN, MSAShape, PagedBatch
from vllm_msa import compat, host_tier
from vllm_msa.config import FP8_CACHE_DTYPES, SERVED_CACHE_DTYPES, MSAModelConfig, served_index_key_dtype
from vllm_msa.observer import OBSERVER
from vllm_msa.registration import BACKEND_NAME

logger = init_logger("vllm.msa")  # under "vllm" so vLLM's log handlers print it

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType


class FlashMSABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list["CacheDType"]] = list(SERVED_CACHE_DTYPES)  # type: ignore[arg-type]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return [128]  # one MSA block per KV page

    @staticmethod
    def get_impl_cls() -> type["FlashMSAImpl"]:
        return FlashMSAImpl

    @staticmethod
    def get_builder_cls() -> type["FlashMSAMetadataBuilder"]:
        return FlashMSAMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # each layer's pages contiguous, each page [Hkv, B, 2 * D] (kv_planes)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class FlashMSAMetadata(AttentionMetadata):
    plan: StepPlan  # the step's batch, its decode and prefill parts and their workspaces
    slot_mapping: torch.Tensor  # [num_actual_tokens] flat cache slots, -1 = padding
    num_actual_tokens: int
    request_keys: list[int] | None = None  # per request row, its key in the selection log (None: the row itself)


StepMetadata = TypeVar("StepMetadata", bound=AttentionMetadata)


class StepMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    """What FLASH_MSA's metadata builders share: vLLM's calls of a builder's constructor and build, with the keywords
    vLLM passes some builders. The constructor ignores vLLM 0.34's builder keywords (block_table_width, for builders
    that ask for it): FLASH_MSA reads the width from each step's block table. build refuses a model's own step
    metadata (vLLM 0.34 passes it by keyword to the builders of models that define it, DeepSeek-V4's replay_start;
    none of FLASH_MSA's models does) by name, then builds the step's metadata (step_metadata)."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: "VllmConfig",
        device: torch.device,
        **builder_kwargs: object,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.configure()

    def configure(self) -> None:
        """A builder's own set-up, once vLLM's attributes (vllm_config, device, ...) are set."""

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
        **model_kwargs: object,
    ) -> StepMetadata:
        if model_kwargs:
            raise NotImplementedError(
                f"FLASH_MSA's metadata builders take no model step metadata: {sorted(model_kwargs)}"
            )
        return self.step_metadata(common_attn_metadata)

    @abstractmethod
    def step_metadata(self, m: CommonAttentionMetadata) -> StepMetadata: ...


class FlashMSAMetadataBuilder(StepMetadataBuilder[FlashMSAMetadata]):
    """Any mix of decode, speculative verification, prefill and chunked prefill. vLLM orders each step's
    requests with the decode requests first: one new token, or under speculative decoding up to 1 +
    num_speculative_tokens (reorder_batch_threshold, raised by vLLM as for its own M3 backend). build
    plans the step there once (StepPlan.of), so every layer of the step runs the decode kernels on the decode
    part and the prefill kernels on the prefill part (kernels/msa_kernels/ops.py). The
    decode kernels run every token on its own, causal by its position, so unlike vLLM's M3 the decode part
    need not be uniform: requests whose drafter proposed fewer tokens, and short chunks of a prompt, run
    there too."""

    def configure(self) -> None:
        compat.reorder_verification_with_decodes(self, SINGLE_TOKEN_DECODE_QUERY_LEN)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: "VllmConfig", kv_cache_spec: KVCacheSpec) -> AttentionCGSupport:
        """Full graphs for uniform decode batches (single-token, or speculative verification with the same
        number of tokens per request) when every MSA layer of the model runs CuTeDSL kernels."""
        device, dtype = compat.model_device_and_dtype(vllm_config)
        layers = compat.attention_layers(vllm_config).values()
        impls = [impl for layer in layers if isinstance(impl := getattr(layer, "impl", None), MSAImpl)]
        if impls and all(impl.graph_capturable(device, dtype) for impl in impls):
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.NEVER

    def step_metadata(self, m: CommonAttentionMetadata) -> FlashMSAMetadata:
        OBSERVER.before_step()  # runs every step, also before a step that replays a full CUDA graph
        batch = PagedBatch(
            query_start_loc=m.query_start_loc[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs],
            block_table=m.block_table_tensor[: m.num_reqs],
            # the CPU-side array vLLM already holds, so building never syncs a device
            query_start_loc_cpu=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
        )
        assert self.reorder_batch_threshold is not None  # set in __init__
        return FlashMSAMetadata(
            plan=StepPlan.of(batch, compat.num_decode_requests(m, self.reorder_batch_threshold)),
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            num_actual_tokens=m.num_actual_tokens,
            request_keys=compat.batch_request_keys(m, m.num_reqs),
        )


class FlashMSAImpl(AttentionImpl[FlashMSAMetadata]):
    """What vLLM builds for a plain attention layer routed to FLASH_MSA (FlashMSABackend.get_impl_cls): refused.
    FLASH_MSA's models build their plain layers on the platform's backend; a model without MSA layers has none, nor
    has a speculative draft (EAGLE) that is given a backend of its own."""

    def __new__(cls, *args: object, **kwargs: object) -> "FlashMSAImpl":
        raise NotImplementedError(
            "FLASH_MSA runs the MSA layers of MSA models (FlashMSAForCausalLM, MiniMax-M3), whose plain attention "
            "layers run vLLM's own backend; this model's attention layers are plain: serve it without "
            "--attention-backend FLASH_MSA. A speculative draft model (EAGLE) has plain layers too: give it a backend "
            'of its own in --speculative-config (e.g. "attention_backend": "FLASH_ATTN")'
        )


class MSAImpl(AttentionImplBase[FlashMSAMetadata]):
    """One MSA layer's step on its paged caches, in three stages that MSAAttention runs in this order (the
    step observer times the stages apart): cache the step's K/V and index keys, select blocks, attend. It holds
    the kernels chosen for its layer (msa_kernels.ops.Kernels), so a call looks nothing up."""

    def __init__(
        self,
        shape: MSAShape,
        scale: float,
        index_key_dtype: torch.dtype,
        device: torch.device,
        dtype: torch.dtype,
        fp8_kv: bool,
    ) -> None:
        """index_key_dtype: the index-key cache's (Fp8IndexKeyCache.dtype: FP8); device, dtype: the model's;
        fp8_kv: an FP8 K/V cache."""
        self.shape = shape
        self.num_heads = shape.num_q_heads
        self.head_size = shape.head_dim
        self.scale = scale
        self.index_key_dtype = index_key_dtype
        self.kernels = ops.kernels(device, dtype, index_key_dtype, fp8_kv, shape)

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        return ops.graph_capturable(device, dtype, self.shape, index_key_dtype=self.index_key_dtype)

    def write_caches(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        index_key: torch.Tensor,
        kv_cache: torch.Tensor,
        index_key_cache: torch.Tensor | Fp8IndexKeyCache,
        attn_metadata: FlashMSAMetadata,
        index_slots: torch.Tensor,
    ) -> None:
        """Store the step's K/V [T, Hkv, D] and index keys [T, Hki, Dp] at their cache slots (index_slots: the
        index-key cache's; an FP8 K/V cache with the layer's K/V scales, index keys quantised for an FP8 cache)."""
        self.write_kv(layer, key, value, kv_cache, attn_metadata.slot_mapping)
        self.kernels.write_index_keys(index_key_cache, index_slots, index_key)

    def write_kv(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store K/V [T, Hkv, D] at the flat slots slot_mapping [T] (< 0: skipped) of a K/V cache in vLLM's layout."""
        kv_cache = reference.kv_planes(kv_cache)
        write_paged(kv_cache[:, 0], kv_cache[:, 1], slot_mapping, key, value, layer)

    def select(
        self,
        index_query: torch.Tensor,
        index_key_cache: torch.Tensor | Fp8IndexKeyCache,
        attn_metadata: FlashMSAMetadata,
    ) -> torch.Tensor:
        """The blocks [T, Hi, K] (-1 = none) each query token's index heads attend to: index scores, top-k."""
        n, plan = attn_metadata.num_actual_tokens, attn_metadata.plan
        selected = ops.layer_selection(plan, self.shape)  # the observer consumes it before the next layer's call
        return self.kernels.select_blocks(index_query[:n], index_key_cache, plan, out=selected)

    def attend(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashMSAMetadata,
        selected: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of each query token [T, Hq, D] over its selected blocks, into output (an FP8 K/V cache read with
        the layer's K/V scales)."""
        n, plan = attn_metadata.num_actual_tokens, attn_metadata.plan
        kv_cache = reference.kv_planes(kv_cache)
        self.kernels.sparse_attention(
            query[:n],
            kv_cache,
            plan,
            selected,
            self.scale,
            out=output[:n],
            kv_scales=layer_kv_scales(layer),
        )

    def attend_through_host_tier(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        tier: host_tier.LayerHostTier,
        attn_metadata: FlashMSAMetadata,
        selected: torch.Tensor,
        output: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """attend with the layer's K/V in its host tier: the prefill part on the host pages, the decode part on the
        device tier once the pages it reads are there (host_tier.py). Returns the decode part's (hits, misses) []
        int32, None for a step without one."""
        n, plan = attn_metadata.num_actual_tokens, attn_metadata.plan
        query, output, kv_scales = query[:n], output[:n], layer_kv_scales(layer)
        host_kv, device_kv = host_tier.kv_planes(tier)
        if (prefill := plan.part("prefill")) is not None:
            self.kernels.attend_part(prefill, query, host_kv, selected, self.scale, output, kv_scales)
        if plan.part("decode") is None:
            return None
        decode, hits, misses = tier.decode_part(plan, selected)
        self.kernels.attend_part(decode, query, device_kv, selected, self.scale, output, kv_scales)
        return hits, misses


def log_msa_layers(model: str, msa: MSAModelConfig, hf_config, vllm_config) -> None:
    """The model's start-up log line: its MSA layers, what runs each step on this rank and the rank's heads, then its
    dense layers and the backend of those this rank holds; a warning naming why where the CuTeDSL kernels leave steps
    to the PyTorch path on a GPU (ops.unserved_reason)."""
    tp_rank, tp_size = compat.tensor_parallel_rank_and_size()
    layout = msa.rank_layout(hf_config, tp_size, tp_rank)
    (device, dtype), shape = compat.model_device_and_dtype(vllm_config), layout.shape
    keys = served_index_key_dtype(vllm_config, msa)
    fp8_kv = vllm_config.cache_config.cache_dtype in FP8_CACHE_DTYPES
    plain_backends = {
        backend.get_name()
        for layer in compat.attention_layers(vllm_config).values()
        if (backend := getattr(layer, "attn_backend", None)) is not None  # vLLM's Attention layers
    }
    logger.info(
        "%s: MSA layers %s on FLASH_MSA (%s; K/V %s; index keys %s; top-%d of %d-token blocks, %d local, %d init; "
        "%s), dense layers %s on %s",
        model,
        msa.sparse_layers(hf_config.num_hidden_layers),
        ops.describe(device, dtype, shape, index_key_dtype=keys),
        "fp8 (e4m3, a scale per tensor)" if fp8_kv else str(dtype).removeprefix("torch."),
        "fp8 (e4m3, a float32 scale per token)" if keys == Fp8IndexKeyCache.dtype else str(keys).removeprefix("torch."),
        msa.topk_blocks,
        msa.block_size,
        msa.local_blocks,
        msa.init_blocks,
        layout.describe(tp_size),
        list(msa.dense_layers),
        f"vLLM's {', '.join(sorted(plain_backends))}" if plain_backends else "vLLM's backend (none on this rank)",
    )
    probe = torch.empty(0, device=device, dtype=dtype)
    kernels_serve = ops.uses_cute_index_scores(probe, shape, index_key_dtype=keys)  # decode: FP8 prefill warns in ops
    kernels_serve = kernels_serve and ops.uses_cute_sparse_attention(probe, shape)
    if probe.is_cuda and not kernels_serve and (reason := ops.unserved_reason(probe.device, dtype, shape)):
        logger.warning(
            "FLASH_MSA: %s; the steps named PyTorch above run the PyTorch path (same results, slower)", reason
        )


def layer_kv_scales(layer: object) -> tuple[float, float]:
    """(k_scale, v_scale) of an attention layer's FP8 K/V cache, vLLM's or MSAAttention (1.0 unless its checkpoint
    carries scales)."""
    return getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0)


def layer_scale_tensors(layer: object, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) of an attention layer's FP8 K/V cache as vLLM's cache op takes them, float32 tensors of one
    element (1 where the layer has none)."""
    unit = compat.unit_scale(device)
    k_scale, v_scale = (getattr(layer, name, unit) for name in ("_k_scale", "_v_scale"))
    if any(scale.numel() != 1 for scale in (k_scale, v_scale)):
        raise NotImplementedError(
            "FLASH_MSA writes FP8 K/V caches with one k/v scale per tensor: this checkpoint's per-head scales are "
            "not served; serve it without --kv-cache-dtype fp8"
        )
    return k_scale, v_scale


def write_paged(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: object = None,
) -> None:
    """Store the step's rows into paged caches [num_pages, B, heads, dim] at flat slots (< 0: skipped); an FP8
    K/V cache gets the e4m3 of key / k_scale and value / v_scale, the scales of the attention layer given (1 without
    one).

    On CUDA vLLM's reshape_and_cache_flash (no host sync, so CUDA graphs can record it); elsewhere the
    reference, which writes the same bytes.
    """
    if key_cache.is_cuda:
        scales = layer_scale_tensors(layer, key_cache.device) if reference.is_fp8_kv(key_cache) else ()
        compat.write_paged_cuda(key_cache, value_cache, slot_mapping, key, value, *scales)
        return
    k_scale, v_scale = layer_kv_scales(layer)
    reference.write_paged(key_cache, slot_mapping, key, k_scale)
    reference.write_paged(value_cache, slot_mapping, value, v_scale)
