"""Makes `--attention-backend FLASH_MSA` and the FlashMSAForCausalLM architecture known to vLLM.

It also takes over vLLM's MiniMaxM3SparseForCausalLM (models/minimax_m3.py), which runs vLLM's own
M3 unless FLASH_MSA is selected, and chains check_minimax_m3_serving_config after vLLM's own config
hook of both M3 architectures; FlashMSAForCausalLM gets config.check_serving_config. Both run when vLLM
builds its config. The MSA op joins vLLM's attention ops, where piecewise CUDA graphs are split.

The FLASH_MSA enum member's value is a str subclass defined here (BackendPath): pickling the vLLM
config into a spawned worker then imports this module (which registers the member) before the enum
value is looked up, so the name resolves in every process, whether or not plugins loaded there yet.
Everything is idempotent: vLLM runs its general plugins in every process, some of them twice.
The vLLM internals behind each step are in compat.py.
"""

from vllm_msa import compat

BACKEND_NAME = "FLASH_MSA"
BACKEND_CLASS = "vllm_msa.backend.FlashMSABackend"
ARCHITECTURES = {"FlashMSAForCausalLM": "vllm_msa.models.flash_msa:FlashMSAForCausalLM"}
M3_OVERRIDE = ("MiniMaxM3SparseForCausalLM", "vllm_msa.models.minimax_m3:FlashMSAMiniMaxM3ForCausalLM")
M3_ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
MSA_OP = "vllm_msa::msa_attention"  # vllm_msa/layer.py


class BackendPath(str):
    """The FLASH_MSA member's value; unpickling it imports this module first."""


def add_backend_name() -> compat.AttentionBackendEnum:
    return compat.register_backend_name(BACKEND_NAME, BackendPath(BACKEND_CLASS))


def register_models() -> None:
    from vllm import ModelRegistry

    from vllm_msa.config import check_minimax_m3_serving_config, check_serving_config

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in ARCHITECTURES.items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)
        compat.add_config_check(arch, check_serving_config)
    ModelRegistry.register_model(*M3_OVERRIDE)  # replaces vLLM's entry (idempotent)
    for arch in M3_ARCHITECTURES:
        compat.add_config_check(arch, check_minimax_m3_serving_config)


def split_graphs_at_msa_op() -> None:
    """Make the MSA op one of the ops vLLM's piecewise compilation splits the model at, as it does for
    its own attention ops: the op then runs eagerly between the captured CUDA graph pieces, with this
    step's metadata (host-side batch layout, metrics, selection log), instead of being replayed from
    a graph captured with another batch."""
    compat.split_piecewise_graphs_at(MSA_OP)


add_backend_name()
