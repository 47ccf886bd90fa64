"""The paged index-key side cache of an MSA layer: one [Hki * Dp] index-key vector per token.

It is its own vLLM layer (its own KV cache spec, key-only) so the KV cache manager allocates it in
the same KV cache group as the layer's K/V: same pages, same block table. Prefix caching,
preemption and chunked prefill therefore keep index keys and K/V consistent without extra code.

In the model's dtype (or bf16) a page is [B, Hki * Dp]; FP8 (indexer_kv_dtype fp8) it is B * Hki * (Dp + 4)
bytes, the e4m3 values then their float32 scales (msa_kernels.fp8_index_keys), and the spec vLLM budgets
its KV cache by counts those bytes.
"""

from dataclasses import dataclass
from typing import ClassVar, NoReturn

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheSpec, MLAAttentionSpec

from msa_kernels.fp8_index_keys import Fp8IndexKeyCache, page_bytes
from vllm_msa import compat
from vllm_msa.backend import FlashMSABackend, StepMetadataBuilder


@dataclass
class IndexKeyMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] flat cache slots, -1 = padding


class IndexKeyMetadataBuilder(StepMetadataBuilder[IndexKeyMetadata]):
    """The index-key caches' step metadata: their slot mapping alone. The step's plan (decode and prefill parts,
    workspaces) is the MSA layers' (FlashMSAMetadataBuilder), built once: the caches share their layers' KV cache
    group, so their pages, block table and slots. Records nothing a CUDA graph could hold stale."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def step_metadata(self, m: CommonAttentionMetadata) -> IndexKeyMetadata:
        return IndexKeyMetadata(slot_mapping=m.slot_mapping[: m.num_actual_tokens])


class IndexKeyCacheBackend(AttentionBackend):
    """Key-only pages [num_pages, 1, block_size, Hki * Dp] (FP8: uint8 pages of page_bytes); metadata: the slot
    mapping (IndexKeyMetadataBuilder)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "FLASH_MSA_INDEX_KEYS"

    @staticmethod
    def get_impl_cls() -> NoReturn:
        raise NotImplementedError("the index-key cache is written and read by its MSA layer's MSAImpl")

    @staticmethod
    def get_builder_cls() -> type[IndexKeyMetadataBuilder]:
        return IndexKeyMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return FlashMSABackend.supported_kv_cache_layouts()  # one KV cache group with its MSA layer


class IndexKeyCache(nn.Module, compat.AttentionLayerBase):
    def __init__(self, num_key_heads: int, head_dim: int, dtype: torch.dtype, prefix: str) -> None:
        """dtype: the index keys' (config.index_key_dtype), Fp8IndexKeyCache.dtype for an FP8 cache."""
        super().__init__()
        self.num_key_heads = num_key_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.prefix = prefix
        self.kv_cache = torch.tensor([])  # bound by vLLM's model runner
        compat.register_attention_layer(prefix, self)

    def pages(self) -> torch.Tensor | Fp8IndexKeyCache:
        """The bound cache as [num_pages, block_size, Hki, Dp], or as an Fp8IndexKeyCache."""
        if self.dtype == Fp8IndexKeyCache.dtype:
            return Fp8IndexKeyCache.from_pages(self.kv_cache, self.kv_cache.shape[2], self.num_key_heads, self.head_dim)
        return self.kv_cache.squeeze(1).unflatten(-1, (self.num_key_heads, self.head_dim))

    def get_attn_backend(self) -> type[AttentionBackend]:
        return IndexKeyCacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return index_key_cache_spec(self.num_key_heads, self.head_dim, vllm_config.cache_config.block_size, self.dtype)

    def forward(self) -> None:  # the cache is filled by its MSA layer
        raise RuntimeError("IndexKeyCache holds pages only")


def index_key_cache_spec(num_key_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The index-key cache spec FLASH_MSA gives vLLM: MLAAttentionSpec budgets one vector per token (no V); an
    FP8 one (dtype Fp8IndexKeyCache.dtype) one row of bytes per token, values and scales."""
    if dtype == Fp8IndexKeyCache.dtype:
        row_bytes = page_bytes(block_size, num_key_heads, head_dim) // block_size
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=row_bytes, dtype=torch.uint8)
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=num_key_heads * head_dim, dtype=dtype)
