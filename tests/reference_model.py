"""FlashMSAForCausalLM written out in plain PyTorch from config.json + model.safetensors, without vLLM.

The oracle for the vLLM integration: greedy decoding re-runs the whole sequence each step (no KV
cache), so nothing vLLM does (paging, prefix caching, chunking, batching) can leak into it. MSA
layers use msa_kernels.reference on a one-request batch with pages in order, the index keys in the format
msa_config.indexer_kv_dtype names (auto: the K/V cache's; bf16; fp8: quantised per token), K/V in the model's
dtype or, with kv_cache_dtype "fp8", in e4m3 as vLLM's FP8 K/V cache holds them (scale 1.0).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.ops import msa_attention
from msa_kernels.plan import StepPlan
from msa_kernels.reference import FP8_KV_STORAGE, fp8_kv_cache
from msa_kernels.shapes import PagedBatch
from vllm_msa.config import MSAModelConfig, index_key_dtype


class _Config(dict):
    __getattr__ = dict.get


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """Neox-style rotary embedding over the last dim of x [T, H, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ReferenceFlashMSA:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        msa_overrides: dict | None = None,
        kv_cache_dtype: str = "auto",
    ):
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        raw["msa_config"] = raw["msa_config"] | (msa_overrides or {})
        self.config = _Config(raw)
        self.msa = MSAModelConfig.from_hf_config(self.config)
        self.shape = self.msa.layer_shape(self.config)
        self.fp8_kv = kv_cache_dtype == "fp8"
        self.index_key_dtype = index_key_dtype(self.msa.indexer_kv_dtype, FP8_KV_STORAGE if self.fp8_kv else dtype)
        self.w = {k: v.to(dtype) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}

    def _attention(self, i, x, positions):
        c, s, w = self.config, self.shape, self.w
        p = f"model.layers.{i}.self_attn."
        n = x.shape[0]
        q = _rope((x @ w[p + "q_proj.weight"].T).view(n, s.num_q_heads, s.head_dim), positions, c.rope_theta)
        k = _rope((x @ w[p + "k_proj.weight"].T).view(n, s.num_kv_heads, s.head_dim), positions, c.rope_theta)
        v = (x @ w[p + "v_proj.weight"].T).view(n, s.num_kv_heads, s.head_dim)
        sparse = self.msa.is_sparse(i)
        shape = s if sparse else s.__class__(**{**s.__dict__, "topk_blocks": -(-n // s.block_size)})
        if sparse:
            iq = (x @ w[p + "index_q_proj.weight"].T).view(n, s.num_index_heads, s.index_head_dim)
            ik = (x @ w[p + "index_k_proj.weight"].T).view(n, s.num_index_key_heads, s.index_head_dim)
            iq = _rope(_rms_norm(iq, w[p + "index_q_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
            ik = _rope(_rms_norm(ik, w[p + "index_k_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        else:  # dense: every block selected, the index branch does not matter
            iq = x.new_zeros(n, s.num_index_heads, s.index_head_dim)
            ik = x.new_zeros(n, s.num_index_key_heads, s.index_head_dim)
        num_pages = -(-n // s.block_size)
        pad = num_pages * s.block_size - n
        kv_cache = torch.stack([k, v], dim=0)
        kv_cache = torch.nn.functional.pad(kv_cache, (0, 0, 0, 0, 0, pad)).view(
            2, num_pages, s.block_size, *k.shape[1:]
        )
        kv_cache = kv_cache.transpose(0, 1)  # [pages, 2, B, Hkv, D]
        if self.fp8_kv:
            kv_cache = fp8_kv_cache(kv_cache)
        index_keys = torch.nn.functional.pad(ik, (0, 0, 0, 0, 0, pad)).view(num_pages, s.block_size, *ik.shape[1:])
        if self.index_key_dtype == Fp8IndexKeyCache.dtype:
            index_keys = Fp8IndexKeyCache.quantize(index_keys)
        else:
            index_keys = index_keys.to(self.index_key_dtype)
        batch = PagedBatch(
            query_start_loc=torch.tensor([0, n]),
            seq_lens=torch.tensor([n]),
            block_table=torch.arange(num_pages)[None, :],
        )
        out, _ = msa_attention(q, iq, kv_cache, index_keys, StepPlan.of(batch), shape, s.head_dim**-0.5)
        return out.reshape(n, -1) @ w[p + "o_proj.weight"].T

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        c, w = self.config, self.w
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
        positions = torch.arange(len(token_ids))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps), positions)
            h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return _rms_norm(x[-1], w["model.norm.weight"], c.rms_norm_eps) @ w["lm_head.weight"].T

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt_ids)
        for _ in range(max_tokens):
            ids.append(int(self.logits(ids).argmax()))
        return ids[len(prompt_ids) :]
