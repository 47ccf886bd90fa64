"""MiniMax-M3 on FLASH_MSA: vLLM's in-tree M3 whose sparse layers run on this project's kernels.

Owns FlashMSAMiniMaxM3ForCausalLM, registered under vLLM's own architecture name
MiniMaxM3SparseForCausalLM (also the text backbone of MiniMaxM3SparseForConditionalGeneration).
With `--attention-backend FLASH_MSA` every sparse layer (sparse_attention_freq != 0) is a
FlashMSAMiniMaxM3Attention: vLLM's fused [q | k | v | index_q | index_k] projection, its fused
Gemma-RMSNorm + partial-NeoX-RoPE op (which also inserts K/V and index keys into FLASH_MSA's caches where both
are bf16/fp16), then MSAAttention (index scores, top-k, sparse attention of msa_kernels.ops on FLASH_MSA's K/V
and index-key caches) and vLLM's o_proj. Parameter names equal vLLM's, so vLLM's M3 weight loading is used
unchanged. Dense layers (on the platform's backend, as under vLLM's own M3: compat.plain_layers_on_platform_backend),
MoE, norms, embeddings and LM head stay vLLM's. With any other backend the model is vLLM's, unchanged.
CUDA only, like vLLM's M3 (its fused op and MoE have no CPU path); vLLM's CUDA graphs stay on
(config.check_minimax_m3_serving_config says how).
"""

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope

from vllm_msa import compat
from vllm_msa.backend import log_msa_layers
from vllm_msa.config import (
    MSAConfigError,
    MSAModelConfig,
    flash_msa_selected,
    m3_fused_op_writes_caches,
    served_index_key_dtype,
)
from vllm_msa.layer import MSAAttention

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

logger = init_logger("vllm.msa")

_M3_MODEL_MODULE = compat.m3_model_module()


class FlashMSAMiniMaxM3Attention(nn.Module):
    """Constructor, parameters and forward of vLLM's MiniMaxM3SparseAttention; attention is MSAAttention."""

    def __init__(
        self,
        config: "PretrainedConfig",
        layer_id: int,
        quant_config: "QuantizationConfig | None" = None,
        prefix: str = "",
        cache_config: CacheConfig | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
        use_sequence_parallel: bool = False,
        run_gemm_rs: bool = False,
    ) -> None:
        super().__init__()
        if use_sequence_parallel:
            raise MSAConfigError("FLASH_MSA does not serve MiniMax-M3 with sequence parallelism")
        msa = MSAModelConfig.from_minimax_m3(config)
        tp_rank, tp_size = compat.tensor_parallel_rank_and_size()
        # vLLM's fused projection splits q evenly and index_q like K/V (even split, or replication when the TP
        # size exceeds the KV heads) and replicates the one index key: rank_layout's rule for this rank.
        layout = msa.rank_layout(config, tp_size, tp_rank)
        full, shape = msa.layer_shape(config), layout.shape
        self.shape = shape
        self.q_size = shape.num_q_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.index_q_size = shape.num_index_heads * shape.index_head_dim
        self.qkv_proj = compat.m3_qkv_index_projection(
            config.hidden_size,
            full.head_dim,
            full.num_q_heads,
            full.num_kv_heads,
            full.num_index_heads,
            full.index_head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # Partial sums per rank: vLLM's decoder layer all-reduces them (fused with its next norm).
        self.o_proj = RowParallelLinear(
            full.num_q_heads * full.head_dim,
            config.hidden_size,
            bias=False,
            reduce_results=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        norm = _M3_MODEL_MODULE.MiniMAXGemmaRMSNorm
        self.q_norm = norm(shape.head_dim, eps=config.rms_norm_eps)
        self.k_norm = norm(shape.head_dim, eps=config.rms_norm_eps)
        self.index_q_norm = norm(shape.index_head_dim, eps=config.rms_norm_eps)
        self.index_k_norm = norm(shape.index_head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(  # M3 ropes the index branch with the same table
            shape.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=compat.m3_sparse_fields(config)["rope_parameters"],
        )
        index_key_dtype = served_index_key_dtype(compat.current_vllm_config(), msa)  # vLLM's M3 option
        self.attn = MSAAttention(
            layout, shape.head_dim**-0.5, cache_config, f"{prefix}.attn", index_key_dtype, quant_config
        )
        # Not with the host tier: the layer writes its K/V to host pages and their device copies (host_tier.py).
        self.attn.caches_written_by_model = self.attn.kv_device_pages is None and m3_fused_op_writes_caches(
            self.attn.kv_cache_dtype, index_key_dtype
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        s = self.shape
        qkv, _ = self.qkv_proj(hidden_states)
        q = qkv.new_empty((qkv.shape[0], self.q_size))
        index_q = qkv.new_empty((qkv.shape[0], self.index_q_size))
        # In place on k and index_k inside qkv; q and index_q written to their own buffers; K/V and index keys
        # stored in the layer's caches where it lets the op write them (no slot mapping: the memory-profiling run).
        slots = compat.step_slot_mapping()
        insert = {}
        if self.attn.caches_written_by_model and slots:
            index_keys = self.attn.index_key_cache
            insert = dict(
                slot_mapping=slots[self.attn.layer_name],
                index_slot_mapping=slots[index_keys.prefix],
                kv_cache=self.attn.kv_cache,
                index_cache=index_keys.kv_cache.squeeze(1),  # [pages, B, Hki * Dp]: a bf16/fp16 cache here
                block_size=s.block_size,
            )
        compat.m3_qknorm_rope(
            qkv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.rotary_emb.cos_sin_cache,
            positions,
            s.num_q_heads,
            s.num_kv_heads,
            self.rotary_emb.rotary_dim,
            self.q_norm.variance_epsilon,
            self.index_q_norm.weight,
            self.index_k_norm.weight,
            s.num_index_heads,
            q_out=q,
            index_q_out=index_q,
            **insert,
        )
        _, k, v, _, index_k = qkv.split(
            [self.q_size, self.kv_size, self.kv_size, self.index_q_size, s.index_head_dim], dim=-1
        )
        return self.o_proj(self.attn(q, k, v, index_q, index_k))[0]


@contextlib.contextmanager
def _sparse_attention_class(cls: type[nn.Module]):
    """vLLM's MiniMaxM3DecoderLayer builds `MiniMaxM3SparseAttention` from its module: swap it while building."""
    original = _M3_MODEL_MODULE.MiniMaxM3SparseAttention
    _M3_MODEL_MODULE.MiniMaxM3SparseAttention = cls
    try:
        yield
    finally:
        _M3_MODEL_MODULE.MiniMaxM3SparseAttention = original


_M3_FOR_CAUSAL_LM: Any = _M3_MODEL_MODULE.MiniMaxM3SparseForCausalLM  # vLLM's M3 model class, nvidia or amd


class FlashMSAMiniMaxM3ForCausalLM(_M3_FOR_CAUSAL_LM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        if not flash_msa_selected(vllm_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            return
        text_config = vllm_config.model_config.hf_text_config
        msa = MSAModelConfig.from_minimax_m3(text_config)  # fail before building anything
        with _sparse_attention_class(FlashMSAMiniMaxM3Attention), compat.plain_layers_on_platform_backend():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        log_msa_layers("MiniMax-M3", msa, text_config, vllm_config)
