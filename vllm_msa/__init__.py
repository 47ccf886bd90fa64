"""vllm-msa: serve MSA (MiniMax Sparse Attention) models with vLLM through the FLASH_MSA backend.

vLLM calls register() (entry point `vllm.general_plugins`) in each of its processes.

    registration  FLASH_MSA backend name, model architectures
    config        a checkpoint's msa_config
    backend       FLASH_MSA backend, metadata builder, impl (proxy scores + top-k + sparse attention)
    proxy_cache   paged proxy-key side cache
    layer         MSAAttention: one MSA layer's caches and custom op
    models/       FlashMSAForCausalLM
"""


def register() -> None:
    from vllm_msa.registration import add_backend_name, register_models

    add_backend_name()
    register_models()
