"""Makes `--attention-backend FLASH_MSA` and the FlashMSAForCausalLM architecture known to vLLM.

It also takes over vLLM's MiniMaxM3SparseForCausalLM (models/minimax_m3.py), which runs vLLM's own
M3 unless FLASH_MSA is selected, and hooks check_minimax_m3_serving_config into both M3 architectures.

The MSA op joins vLLM's attention ops, where piecewise CUDA graphs are split (split_graphs_at_msa_op).
The architecture also gets vLLM's per-architecture config hook (MODELS_CONFIG_MAP, as vLLM's own
sparse-attention models use): config.check_serving_config, run when vLLM builds its config.

vLLM 0.26 parses the flag with `AttentionBackendEnum[name]`, and its enum has no FLASH_MSA member,
so this module adds one. The member's value is a str subclass defined here: pickling the vLLM config
into a spawned worker then imports this module (which adds the member again) before the enum value
is looked up, so the name resolves in every process, whether or not plugins loaded there yet.
Everything is idempotent: vLLM runs its general plugins in every process, some of them twice.
"""

from vllm.v1.attention.backends.registry import AttentionBackendEnum

BACKEND_NAME = "FLASH_MSA"
BACKEND_CLASS = "vllm_msa.backend.FlashMSABackend"
ARCHITECTURES = {"FlashMSAForCausalLM": "vllm_msa.models.flash_msa:FlashMSAForCausalLM"}
M3_OVERRIDE = ("MiniMaxM3SparseForCausalLM", "vllm_msa.models.minimax_m3:FlashMSAMiniMaxM3ForCausalLM")
M3_ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
MSA_OP = "vllm_msa::msa_attention"  # vllm_msa/layer.py


class _BackendPath(str):
    """The FLASH_MSA member's value; unpickling it imports this module first."""


def add_backend_name() -> AttentionBackendEnum:
    enum = AttentionBackendEnum
    if BACKEND_NAME in enum.__members__:
        return enum[BACKEND_NAME]
    value = _BackendPath(BACKEND_CLASS)
    member = object.__new__(enum)
    member._name_ = BACKEND_NAME
    member._value_ = value
    member.__objclass__ = enum
    member._sort_order_ = len(enum._member_names_)
    type.__setattr__(enum, BACKEND_NAME, member)  # EnumType.__setattr__ refuses member names
    enum._member_names_.append(BACKEND_NAME)
    enum._member_map_[BACKEND_NAME] = member
    enum._value2member_map_[value] = member
    return member


def register_models() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from vllm_msa.config import check_minimax_m3_serving_config, check_serving_config

    class FlashMSAServingConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            check_serving_config(vllm_config)

    class MiniMaxM3ServingConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            check_minimax_m3_serving_config(vllm_config)

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in ARCHITECTURES.items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)
        MODELS_CONFIG_MAP.setdefault(arch, FlashMSAServingConfig)
    ModelRegistry.register_model(*M3_OVERRIDE)  # replaces vLLM's entry (idempotent)
    for arch in M3_ARCHITECTURES:
        MODELS_CONFIG_MAP.setdefault(arch, MiniMaxM3ServingConfig)


def split_graphs_at_msa_op() -> None:
    """Make the MSA op one of the ops vLLM's piecewise compilation splits the model at, as it does for
    its own attention ops: the op then runs eagerly between the captured CUDA graph pieces, with this
    step's metadata (host-side batch layout, metrics, selection log), instead of being replayed from
    a graph captured with another batch."""
    from vllm.config.compilation import CompilationConfig

    if MSA_OP not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(MSA_OP)


add_backend_name()
