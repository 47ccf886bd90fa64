"""vllm-msa: serve MSA (MiniMax Sparse Attention) models with vLLM through the FLASH_MSA backend.

vLLM calls register() (entry point `vllm.general_plugins`) in each of its processes; on a vLLM outside
the supported versions it stops there, naming them (compat.check_vllm_version).

    compat          every touch of vLLM internals; the supported vLLM versions
    registration    FLASH_MSA backend name, model architectures, their config check
    config          a checkpoint's msa_config; what FLASH_MSA can serve
    backend         FLASH_MSA backend, metadata builder, MSAImpl (index
                    scores + top-k + sparse attention)
    index_key_cache paged index-key side cache
    layer           MSAAttention: one MSA layer's caches and custom op
    host_tier       option: an MSA layer's K/V in host memory, the pages decode steps read in a device tier
    observer        the one hook on MSA layer calls: feeds the metrics and the selection log
    metrics         Prometheus metrics of the sparse layers, worker -> API server /metrics
    selection_log   debug option: log the selected blocks of a marked request
    sizing          `python -m vllm_msa.sizing`: context that fits per GPU for a checkpoint and parallel layout
    checkpoint      the format of the checkpoints this project builds: config.json, tensor names, special tokens
    models/         FlashMSAForCausalLM; MiniMax-M3 with its sparse layers on FLASH_MSA
"""


def register() -> None:
    from vllm_msa import compat  # noqa: F401  (first: refuses an unsupported vLLM with its message)

    # isort: split
    from vllm_msa import metrics
    from vllm_msa.registration import add_backend_name, register_models, split_graphs_at_msa_op

    add_backend_name()
    split_graphs_at_msa_op()
    register_models()
    metrics.install()
