"""FlashMSAForCausalLM: a Llama-style GQA decoder whose non-dense layers are MSA layers.

Everything but attention is vLLM's Llama (embeddings, RMSNorm, SwiGLU MLP, LM head, weight loading).
Dense layers (msa_config.dense_layers) are vLLM's LlamaAttention on the platform's attention backend, also under
FLASH_MSA (compat.plain_layers_on_platform_backend).
MSA layers add the index branch of docs/MSA_SPEC.md:
    index_q = RoPE(RMSNorm(index_q_proj(x)))  [T, Hi, Dp]     index_k = RoPE(RMSNorm(index_k_proj(x)))  [T, Hki, Dp]
and attend through MSAAttention (FLASH_MSA). On a GPU, shapes the CuTeDSL kernels do not serve run
the PyTorch path, with a warning at start-up. Checkpoint names follow HF Llama plus
`self_attn.index_{q,k}_proj.weight` and `self_attn.index_{q,k}_norm.weight` on MSA layers.
"""

from collections.abc import Iterable
from contextlib import nullcontext
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from vllm_msa import compat
from vllm_msa.backend import log_msa_layers
from vllm_msa.config import MSAModelConfig, flash_msa_selected, served_index_key_dtype
from vllm_msa.layer import MSAAttention

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

logger = init_logger("vllm.msa")  # under "vllm" so vLLM's log handlers print it


class FlashMSAAttention(nn.Module):
    """Same constructor and forward as vLLM's LlamaAttention, so LlamaDecoderLayer can hold either."""

    def __init__(
        self,
        config: "PretrainedConfig",
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config: "QuantizationConfig | None" = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        attn_type: str | None = None,
    ) -> None:
        super().__init__()
        msa = MSAModelConfig.from_hf_config(config)
        tp_rank, tp_size = compat.tensor_parallel_rank_and_size()
        layout = msa.rank_layout(config, tp_size, tp_rank)
        full, shape = msa.layer_shape(config), layout.shape
        self.shape = shape
        d, dp = shape.head_dim, shape.index_head_dim
        self.q_size, self.kv_size = shape.num_q_heads * d, shape.num_kv_heads * d
        # This rank's index (key) heads within the replicated projections' outputs.
        self.index_q_cols = slice(layout.index_heads.start * dp, layout.index_heads.stop * dp)
        self.index_k_cols = slice(layout.index_key_heads.start * dp, layout.index_key_heads.stop * dp)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, d, num_heads, num_kv_heads, bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj"
        )
        self.o_proj = RowParallelLinear(
            num_heads * d, hidden_size, bias=bias_o_proj, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        # Replicated: every rank projects all index (key) heads, then keeps its own (at most Hi x Dp columns,
        # small beside q/k/v), so any split of heads over ranks loads the checkpoint's weights unchanged.
        self.index_q_proj = ReplicatedLinear(
            hidden_size,
            full.num_index_heads * dp,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.index_q_proj",
        )
        self.index_k_proj = ReplicatedLinear(
            hidden_size,
            full.num_index_key_heads * dp,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.index_k_proj",
        )
        self.index_q_norm = RMSNorm(dp, eps=config.rms_norm_eps)
        self.index_k_norm = RMSNorm(dp, eps=config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None)
        self.rotary_emb = get_rope(d, max_position=max_position_embeddings, rope_parameters=rope)
        self.index_rotary_emb = get_rope(dp, max_position=max_position_embeddings, rope_parameters=rope)
        index_key_dtype = served_index_key_dtype(compat.current_vllm_config(), msa)
        self.attn = MSAAttention(layout, d**-0.5, cache_config, f"{prefix}.attn", index_key_dtype, quant_config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        index_q = self._norm_heads(self.index_q_norm, self.index_q_proj(hidden_states)[0][:, self.index_q_cols])
        index_k = self._norm_heads(self.index_k_norm, self.index_k_proj(hidden_states)[0][:, self.index_k_cols])
        index_q, index_k = self.index_rotary_emb(positions, index_q, index_k)
        output, _ = self.o_proj(self.attn(q, k, v, index_q, index_k))
        return output

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, self.shape.index_head_dim)).reshape(x.shape)


class FlashMSADecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: "PretrainedConfig | None" = None) -> None:
        config = config or vllm_config.model_config.hf_config
        sparse = MSAModelConfig.from_hf_config(config).is_sparse(extract_layer_index(prefix))
        attention = FlashMSAAttention if sparse else LlamaAttention
        super().__init__(vllm_config, prefix, cast("LlamaConfig", config), attn_layer_type=attention)


class FlashMSAForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        hf_config = vllm_config.model_config.hf_config
        msa = MSAModelConfig.from_hf_config(hf_config)  # fail before building anything
        plain_layers = compat.plain_layers_on_platform_backend() if flash_msa_selected(vllm_config) else nullcontext()
        with plain_layers:
            super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=FlashMSADecoderLayer)
        log_msa_layers("FlashMSAForCausalLM", msa, hf_config, vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Index weights of layers this config runs dense (e.g. all of them, for a dense baseline) are unused.
        params = dict(self.named_parameters())
        return super().load_weights((n, w) for n, w in weights if ".index_" not in n or n in params)
