"""The `msa_config` block of a Flash-MSA checkpoint's config.json: parsing, validation, per-layer shapes.

    "msa_config": {"block_size": 128, "topk_blocks": 16, "local_blocks": 1, "init_blocks": 0,
                   "num_index_heads": 4, "num_index_key_heads": 1, "index_head_dim": 128,
                   "dense_layers": [0, 1, 2]}

Layers listed in dense_layers run plain dense attention; every other layer is an MSA layer.

check_serving_config() runs in vLLM's API server process while it builds its config (vLLM's
per-architecture hook, registered by registration.py), so a checkpoint or flag FLASH_MSA cannot
serve stops `vllm serve` before any engine process starts, with a message naming the fix.
"""

from dataclasses import MISSING, dataclass, fields

from kernels.shapes import MSAShape

SERVED_BLOCK_SIZES = (128,)  # tokens per MSA block (== KV page) the FLASH_MSA backend serves


class MSAConfigError(ValueError):
    """A checkpoint's MSA fields cannot be served; the message names the field and the fix."""


@dataclass(frozen=True)
class MSAModelConfig:
    block_size: int
    topk_blocks: int
    num_index_heads: int
    index_head_dim: int
    num_index_key_heads: int = 1
    local_blocks: int = 1
    init_blocks: int = 0
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf_config) -> "MSAModelConfig":
        raw = getattr(hf_config, "msa_config", None)
        if not isinstance(raw, dict):
            raise MSAConfigError(
                "this checkpoint has no 'msa_config' in config.json, so it has no MSA layers to serve; "
                "add the block described in the vllm-msa README or serve it without FlashMSAForCausalLM"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise MSAConfigError(f"msa_config has unknown fields {unknown}; known fields: {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in raw]
        if required:
            raise MSAConfigError(f"msa_config is missing {required}")
        values = dict(raw)
        values["dense_layers"] = tuple(int(i) for i in raw.get("dense_layers", ()))
        for name, value in values.items():
            if name != "dense_layers" and (not isinstance(value, int) or isinstance(value, bool)):
                raise MSAConfigError(f"msa_config.{name} must be an integer, got {value!r}")
        config = cls(**values)
        num_layers = hf_config.num_hidden_layers
        bad = [i for i in config.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise MSAConfigError(f"msa_config.dense_layers {bad} outside 0..{num_layers - 1}")
        config.layer_shape(hf_config)  # validates head counts and top-k against the model
        return config

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers

    def layer_shape(self, hf_config) -> MSAShape:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        try:
            return MSAShape(
                num_q_heads=num_heads,
                num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
                head_dim=head_dim,
                num_index_heads=self.num_index_heads,
                num_index_key_heads=self.num_index_key_heads,
                index_head_dim=self.index_head_dim,
                topk_blocks=self.topk_blocks,
                local_blocks=self.local_blocks,
                init_blocks=self.init_blocks,
                block_size=self.block_size,
            )
        except ValueError as e:
            raise MSAConfigError(f"msa_config does not fit this model: {e}") from None


def check_serving_config(vllm_config) -> None:
    """Validate msa_config, --block-size and parallelism for FlashMSAForCausalLM; pin the block size."""
    msa = MSAModelConfig.from_hf_config(vllm_config.model_config.hf_config)
    if msa.block_size not in SERVED_BLOCK_SIZES:
        raise MSAConfigError(
            f"msa_config.block_size {msa.block_size} is not served: FLASH_MSA keeps one MSA block per KV page "
            f"and serves blocks of {list(SERVED_BLOCK_SIZES)} tokens"
        )
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and cache.block_size != msa.block_size:
        raise MSAConfigError(
            f"FLASH_MSA keeps one MSA block per KV page: serve this model with --block-size "
            f"{msa.block_size} (its msa_config.block_size), not {cache.block_size}"
        )
    cache.block_size = msa.block_size
    cache.user_specified_block_size = True  # keeps platform and backend defaults from changing it
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise MSAConfigError(
            "FlashMSAForCausalLM runs with --tensor-parallel-size 1 and --pipeline-parallel-size 1 only"
        )
