"""MSAAttention: the attention-backend wiring of one MSA layer inside a vLLM model.

It owns the layer's paged K/V cache (a FullAttentionSpec, registered with vLLM like any attention
layer; an FP8 one written with the checkpoint's per-tensor K/V scales, as vLLM's attention layers load
them, or 1.0 where it has none, said at start-up, its saturated values counted by the observer) and its
index-key side cache (in the format indexer_kv_dtype names: config.py), or with the host tier (host_tier.py) a
placeholder vLLM budgets, its K/V in host memory and a device tier of the pages decode steps read, and runs its
MSAImpl (backend.py) behind one opaque custom op (`torch.ops.vllm_msa.msa_attention`), so
torch.compile traces the model around it (and vLLM splits its piecewise CUDA graphs there; breakable
graphs break there). Each call runs the impl's three stages (cache writes, block selection, sparse
attention) inside a step of the observer (observer.py), which turns the selections and stage times
into the sparse-layer metrics and the selection log. Where a KV connector is configured (vLLM's
--kv-transfer-config: disaggregated prefill, offload), the call waits for the connector to load the layer's
K/V and its index keys (two vLLM layers: the index-key cache is its own) and saves both after, through vLLM's
own per-layer hooks, as vLLM's attention ops do.
"""

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.library import Library
from vllm.config import CacheConfig, VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from msa_kernels.shapes import MSAShape
from vllm_msa import compat
from vllm_msa.backend import FlashMSABackend, FlashMSAMetadata, MSAImpl, layer_kv_scales
from vllm_msa.config import FP8_CACHE_DTYPES, MSAConfigError, RankLayout, kv_device_pages
from vllm_msa.host_tier import LayerHostTier, resident_kv_spec
from vllm_msa.index_key_cache import IndexKeyCache, IndexKeyMetadata
from vllm_msa.observer import OBSERVER

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

logger = init_logger("vllm.msa")  # under "vllm" so vLLM's log handlers print it


class MSAAttention(nn.Module, compat.AttentionLayerBase):
    impl: MSAImpl  # type: ignore[assignment]  # an AttentionImplBase, as vLLM's own M3 sparse layers hold

    def __init__(
        self,
        layout: RankLayout,
        scale: float,
        cache_config: CacheConfig | None,
        prefix: str,
        index_key_dtype: torch.dtype,
        quant_config: "QuantizationConfig | None" = None,
    ) -> None:
        """layout: this tensor-parallel rank's part of the layer (MSAModelConfig.rank_layout); index_key_dtype: its
        index-key cache's (config.served_index_key_dtype; Fp8IndexKeyCache.dtype for FP8); quant_config: the
        checkpoint's, whose per-tensor K/V scales (`prefix`.k_scale, .v_scale) an FP8 K/V cache is written with."""
        super().__init__()
        vllm_config = compat.current_vllm_config()
        shape = layout.shape
        self.layer_name = prefix
        self.shape = shape
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        self.kv_cache_torch_dtype = compat.cache_torch_dtype(self.kv_cache_dtype, vllm_config.model_config)
        self.fp8_kv = self.kv_cache_dtype in FP8_CACHE_DTYPES
        compat.init_kv_cache_scales(self, quant_config, prefix)
        device, dtype = compat.model_device_and_dtype(vllm_config)
        self.impl = MSAImpl(shape, scale, index_key_dtype, device, dtype, self.fp8_kv)
        self.index_key_cache = IndexKeyCache(
            shape.num_index_key_heads, shape.index_head_dim, index_key_dtype, f"{prefix}.index_key_cache"
        )
        self.kv_device_pages = kv_device_pages(vllm_config)  # the host tier's device pages; None: no tier
        # The model's layers, to size the host tiers when vLLM binds the caches (with the tier only).
        self.model_layers = compat.attention_layers(vllm_config) if self.kv_device_pages is not None else {}
        self.host_tier: LayerHostTier | None = None  # allocated when vLLM binds the tier's placeholder cache
        self.kv_cache = torch.tensor([])  # bound by vLLM's model runner
        # True where the model's own pre-attention op stores the step's K/V and index keys (MiniMax-M3's fused
        # norm/RoPE op, models/minimax_m3.py); the layer then writes neither.
        self.caches_written_by_model = False
        compat.register_attention_layer(prefix, self)
        OBSERVER.register(prefix, layout)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The K/V cache vLLM bound (with the host tier: its placeholder; the K/V are in host_tier)."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor) -> None:
        self._kv_cache = cache
        if self.kv_device_pages is not None and cache.numel():
            waiting = [
                layer
                for layer in self.model_layers.values()
                if isinstance(layer, MSAAttention) and layer.kv_device_pages is not None and layer.host_tier is None
            ]
            self.host_tier = LayerHostTier.allocate(
                cache.shape[0],
                self.kv_device_pages,
                self.shape,
                self.kv_cache_torch_dtype,
                cache.device,
                layers_to_allocate=max(1, len(waiting)),
            )

    def get_attn_backend(self) -> type[AttentionBackend]:
        return FlashMSABackend

    def process_weights_after_loading(self, act_dtype: torch.dtype | None = None) -> None:
        """After the checkpoint's K/V scales were loaded (vLLM calls this after the layer's quant method: 0.32
        with the model's dtype, 0.34 with no argument; neither is needed): say at start-up which scales an FP8
        K/V cache is written with."""
        if not self.fp8_kv:
            return
        k_scale, v_scale = layer_kv_scales(self)
        if k_scale == v_scale == 1.0:
            logger.warning_once(
                "FLASH_MSA: MSA layers write their FP8 K/V cache with K/V scale 1.0 (the checkpoint carries no "
                "k_scale/v_scale): values past +-448 are stored saturated, counted by vllm:msa_kv_saturated_total"
            )
            return
        logger.info_once("FLASH_MSA: MSA layers write their FP8 K/V cache with the checkpoint's k_scale and v_scale")
        logger.debug("FLASH_MSA: %s K/V scales k %g, v %g", self.layer_name, k_scale, v_scale)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        # Asked after vLLM settled the block size (FlashMSABackend prefers 128 when none was given).
        block_size = vllm_config.cache_config.block_size
        if block_size != self.shape.block_size:
            raise MSAConfigError(
                f"FLASH_MSA keeps one MSA block per KV page: serve this model with --block-size "
                f"{self.shape.block_size} (its msa_config.block_size), not {block_size}"
            )
        if self.kv_device_pages is not None:
            return resident_kv_spec(self.shape, self.kv_cache_torch_dtype)
        return kv_cache_spec(self.shape, self.kv_cache_torch_dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D], index_q [T, Hi*Dp], index_k [T, Hki*Dp] -> [T, Hq*D]."""
        output = torch.empty_like(q)
        torch.ops.vllm_msa.msa_attention(q, k, v, index_q, index_k, output, self.layer_name)
        return output

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        attn_metadata = compat.step_attn_metadata()
        if not isinstance(attn_metadata, dict):  # memory-profiling run: caches are not bound yet
            output.zero_()
            return
        s, impl, tier = self.shape, self.impl, self.host_tier
        kv_cache = self.kv_cache if tier is None else tier.host_view
        metadata = cast(FlashMSAMetadata, attn_metadata[self.layer_name])
        index_slots = cast(IndexKeyMetadata, attn_metadata[self.index_key_cache.prefix]).slot_mapping
        index_key_cache = self.index_key_cache.pages()
        clock = OBSERVER.stage_clock(q.device)  # None unless this call is timed
        key, value = k.view(-1, s.num_kv_heads, s.head_dim), v.view(-1, s.num_kv_heads, s.head_dim)
        if not self.caches_written_by_model:
            impl.write_caches(
                self,
                key,
                value,
                index_k.view(-1, s.num_index_key_heads, s.index_head_dim),
                kv_cache,
                index_key_cache,
                metadata,
                index_slots,
            )
            if tier is not None:  # and to the pages' copies in the device tier
                impl.write_kv(self, key, value, tier.device_pages, tier.device_slots(metadata.slot_mapping))
        if self.fp8_kv:
            OBSERVER.count_saturated(key, value, metadata, layer_kv_scales(self))
        if clock is not None:
            clock.mark()  # the selection starts
        selected = impl.select(index_q.view(-1, s.num_index_heads, s.index_head_dim), index_key_cache, metadata)
        if clock is not None:
            clock.mark()  # the attention starts
        query, out = q.view(-1, s.num_q_heads, s.head_dim), output.view(-1, s.num_q_heads, s.head_dim)
        if tier is None:
            impl.attend(self, query, self.kv_cache, metadata, selected, out)
        elif (counts := impl.attend_through_host_tier(self, query, tier, metadata, selected, out)) is not None:
            OBSERVER.count_host_tier(*counts, tier.page_bytes)
        OBSERVER.layer_done(self.layer_name, selected, metadata, clock)


def kv_cache_spec(shape: MSAShape, dtype: torch.dtype) -> KVCacheSpec:
    """The K/V cache spec FLASH_MSA gives vLLM for a layer of this (per-rank) shape, MSA or dense."""
    return FullAttentionSpec(  # vLLM's page [Hkv, B, 2 * D], as its FlashAttention backend's (reference.kv_planes)
        block_size=shape.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_dim,
        head_size_v=shape.head_dim,
        dtype=dtype,
    )


@compat.eager_break_during_capture  # vLLM's breakable CUDA graphs (M3) run the op eagerly, as their attention
@compat.transfer_kv_layer  # a KV connector loads this layer's K/V before the call and saves them after
def _msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    layer = cast(MSAAttention, compat.step_layer(layer_name))
    _with_index_keys(layer.index_key_cache.prefix, layer.run, q, k, v, index_q, index_k, output)


@compat.transfer_kv_layer  # and the layer's index keys, inside: loaded before its run, saved after
def _with_index_keys(layer_name: str, run, *args) -> None:
    run(*args)


def _msa_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


_LIBRARY = Library("vllm_msa", "FRAGMENT")
compat.register_custom_op(_LIBRARY, "msa_attention", _msa_attention, _msa_attention_fake, mutates_args=["output"])
