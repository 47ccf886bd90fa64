"""Plugin registration (the FLASH_MSA name in every process), msa_config validation and the index-key cache format
(indexer_kv_dtype)."""

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from msa_kernels.fp8_index_keys import Fp8IndexKeyCache
from msa_kernels.reference import FP8_KV_STORAGE
from vllm_msa.config import MSAConfigError, MSAModelConfig, index_key_dtype, served_indexer_kv_dtype

ROOT = Path(__file__).resolve().parents[1]


def test_flash_msa_resolves_like_a_builtin_backend_and_unknown_names_still_fail():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import vllm_msa
    from vllm_msa.backend import FlashMSABackend

    vllm_msa.register()
    vllm_msa.register()  # vLLM loads plugins in every process, sometimes twice
    assert [m.name for m in AttentionBackendEnum].count("FLASH_MSA") == 1
    backend = AttentionConfig(backend="flash_msa").backend
    assert backend is AttentionBackendEnum.FLASH_MSA and backend.get_class() is FlashMSABackend
    with pytest.raises(ValueError, match="Unknown attention backend: 'NOPE'"):
        AttentionConfig(backend="NOPE")


def test_config_with_flash_msa_unpickles_in_a_process_that_never_loaded_the_plugin():
    from vllm.config.attention import AttentionConfig

    import vllm_msa

    vllm_msa.register()
    payload = pickle.dumps(AttentionConfig(backend="FLASH_MSA"))
    child = "import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); print(c.backend.name, c.backend.get_path())"
    out = subprocess.run([sys.executable, "-c", child], input=payload, capture_output=True, check=True, timeout=300)
    assert out.stdout.decode().splitlines()[-1].split() == ["FLASH_MSA", "vllm_msa.backend.FlashMSABackend"]


def test_plugin_refuses_a_vllm_outside_the_supported_versions_by_name():
    from vllm_msa.compat import check_vllm_version

    for supported in ("0.32.0+cpu", "0.34.0", "0.34.1"):
        check_vllm_version(supported)
    with pytest.raises(ImportError, match=r"vllm-msa supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x .* vLLM 0\.26\.0"):
        check_vllm_version("0.26.0")
    # As vLLM loads the plugin: the installed vLLM reporting an old version stops register() with that message.
    child = "import vllm; vllm.__version__ = '0.26.0'; import vllm_msa; vllm_msa.register()"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0 and "vllm-msa supports vLLM 0.32.x" in out.stderr, out.stderr[-2000:]


def test_vllm_cli_rejects_an_unknown_backend_name(demo_model):
    vllm = Path(sys.executable).with_name("vllm")
    out = subprocess.run(
        [str(vllm), "serve", str(demo_model), "--attention-backend", "NO_SUCH_BACKEND", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "Unknown attention backend: 'NO_SUCH_BACKEND'" in out.stdout + out.stderr


class _HF:
    def __init__(self, **kw):
        base = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=256, head_dim=32)
        self.__dict__.update(base | kw)


MSA = dict(block_size=128, topk_blocks=4, num_index_heads=4, index_head_dim=32, dense_layers=[0])


def test_msa_config_parses_and_builds_layer_shapes():
    config = MSAModelConfig.from_hf_config(_HF(msa_config=MSA))
    assert config.dense_layers == (0,) and not config.is_sparse(0) and config.is_sparse(3)
    shape = config.layer_shape(_HF(msa_config=MSA))
    assert (shape.num_q_heads, shape.num_kv_heads, shape.num_index_heads, shape.heads_per_index_head) == (8, 2, 4, 2)


@pytest.mark.parametrize(
    "msa_config, message",
    [
        (None, "has no 'msa_config'"),
        ({k: v for k, v in MSA.items() if k != "topk_blocks"}, r"missing \['topk_blocks'\]"),
        (MSA | {"topk": 3}, r"unknown fields \['topk'\]"),
        (MSA | {"topk_blocks": "4"}, "msa_config.topk_blocks must be an integer"),
        (MSA | {"num_index_heads": 3}, "num_index_heads 3 must be a multiple of num_kv_heads 2"),
        (MSA | {"dense_layers": [7]}, r"dense_layers \[7\] outside 0..3"),
        (MSA | {"dense_layers": "12"}, "msa_config.dense_layers must be a list of layer indices, got '12'"),
        (MSA | {"dense_layers": [0, "1"]}, r"msa_config.dense_layers must be a list of layer indices, got \[0, '1'\]"),
        (MSA | {"local_blocks": True}, "msa_config.local_blocks must be an integer, got True"),
        (MSA | {"indexer_kv_dtype": 8}, "msa_config.indexer_kv_dtype must be a string, got 8"),
        (
            MSA | {"indexer_kv_dtype": "nvfp4"},
            r"msa_config.indexer_kv_dtype 'nvfp4' is not served: FLASH_MSA keeps index keys as one of "
            r"\['auto', 'bf16', 'fp8', 'fp8_e4m3'\]",
        ),
    ],
)
def test_bad_msa_config_names_the_field(msa_config, message):
    hf = _HF() if msa_config is None else _HF(msa_config=msa_config)
    with pytest.raises(MSAConfigError, match=message):
        MSAModelConfig.from_hf_config(hf)


def _attention_config(indexer_kv_dtype: str) -> SimpleNamespace:
    from vllm.config.attention import AttentionConfig

    return SimpleNamespace(attention_config=AttentionConfig(indexer_kv_dtype=indexer_kv_dtype))


def test_indexer_kv_dtype_comes_from_the_attention_config_else_msa_config_and_names_the_cache_dtype():
    fp8 = Fp8IndexKeyCache.dtype
    checkpoint = MSAModelConfig.from_hf_config(_HF(msa_config=MSA | {"indexer_kv_dtype": "fp8"}))
    plain = MSAModelConfig.from_hf_config(_HF(msa_config=MSA))
    assert plain.indexer_kv_dtype == "auto"
    assert served_indexer_kv_dtype(_attention_config("auto"), checkpoint) == "fp8"
    assert served_indexer_kv_dtype(_attention_config("bf16"), checkpoint) == "bf16"  # the command line wins
    assert served_indexer_kv_dtype(_attention_config("fp8"), plain) == "fp8"
    with pytest.raises(MSAConfigError, match="--attention-config indexer_kv_dtype 'mxfp4' is not served"):
        served_indexer_kv_dtype(_attention_config("mxfp4"), plain)
    assert index_key_dtype("auto", torch.float32) == torch.float32
    assert index_key_dtype("bf16", torch.float32) == torch.bfloat16
    assert index_key_dtype("fp8", torch.bfloat16) == index_key_dtype("fp8_e4m3", torch.float32) == fp8
    assert index_key_dtype("auto", FP8_KV_STORAGE) == fp8  # an FP8 K/V cache: FP8 index keys, as vLLM's auto
    assert index_key_dtype("bf16", FP8_KV_STORAGE) == torch.bfloat16


@pytest.mark.parametrize(
    "block_size, user_block_size, cache_dtype, message",
    [
        (128, 64, "auto", r"serve this model with --block-size 128 \(its msa_config.block_size\), not 64"),
        (64, 64, "auto", "msa_config.block_size 64 is not served"),
        (128, 128, "fp8_e5m2", "--kv-cache-dtype fp8_e5m2 is not served"),
    ],
)
def test_unservable_cache_flags_name_the_fix(block_size, user_block_size, cache_dtype, message):
    """The cache checks vLLM's config build runs (tests/test_server_config.py runs three such cases through
    `vllm serve`)."""
    from vllm_msa.config import _check_cache

    cache = SimpleNamespace(block_size=user_block_size, user_specified_block_size=True, cache_dtype=cache_dtype)
    vllm_config = SimpleNamespace(cache_config=cache, device_config=SimpleNamespace(device_type="cpu"))
    vllm_config.attention_config = _attention_config("auto").attention_config
    msa = MSAModelConfig.from_hf_config(_HF(msa_config=MSA | {"block_size": block_size}))
    with pytest.raises(MSAConfigError, match=message):
        _check_cache(vllm_config, msa)


def _fp8_cache_config(device_type: str):
    cache = SimpleNamespace(block_size=128, user_specified_block_size=False, cache_dtype="fp8")
    vllm_config = SimpleNamespace(cache_config=cache, device_config=SimpleNamespace(device_type=device_type))
    vllm_config.attention_config = _attention_config("auto").attention_config
    return cache, vllm_config


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "xpu"])
def test_fp8_kv_cache_is_served_on_cpu_and_cuda_and_refused_by_name_elsewhere(device_type):
    from vllm_msa.config import _check_cache

    cache, vllm_config = _fp8_cache_config(device_type)
    msa = MSAModelConfig.from_hf_config(_HF(msa_config=MSA))
    if device_type == "xpu":
        with pytest.raises(MSAConfigError, match="--kv-cache-dtype fp8 is served on cpu and cuda only.*not on xpu"):
            _check_cache(vllm_config, msa)
    else:
        _check_cache(vllm_config, msa)
        assert cache.block_size == 128


def test_fp8_kv_cache_is_refused_where_vllm_writes_another_fp8_type(monkeypatch):
    """ROCm reports device type cuda; on its MI300 vLLM's FP8 type is e4m3fnuz, which FLASH_MSA does not read."""
    from vllm_msa import compat
    from vllm_msa.config import _check_cache

    monkeypatch.setattr(compat, "platform_fp8_dtype", lambda: torch.float8_e4m3fnuz)
    _, vllm_config = _fp8_cache_config("cuda")
    with pytest.raises(MSAConfigError, match="vLLM writes torch.float8_e4m3fnuz K/V pages on this platform"):
        _check_cache(vllm_config, MSAModelConfig.from_hf_config(_HF(msa_config=MSA)))


@pytest.mark.parametrize(
    "transfer, offload, refused",
    [
        ({"kv_connector": "ExampleConnector"}, None, None),
        ({"kv_connector": "NixlConnector"}, None, "--kv-transfer-config runs KV connector NixlConnector"),
        (
            {
                "kv_connector": "MultiConnector",
                "kv_connector_extra_config": {
                    "connectors": [{"kv_connector": "ExampleConnector"}, {"kv_connector": "P2pNcclConnector"}]
                },
            },
            None,
            r"--kv-transfer-config \(MultiConnector\) runs KV connector P2pNcclConnector",
        ),
        # vLLM's OffloadingConnector: shown right on the GPU (dev/gpu/kv_connectors.py --checks offload)
        (None, "native", None),
        (None, "lmcache", "--kv-offloading-size runs KV connector LMCacheMPConnector"),
    ],
)
def test_kv_connectors_not_verified_with_index_key_caches_are_refused_by_name(monkeypatch, transfer, offload, refused):
    """A connector that may move K/V without the index keys is refused at start-up (tests/test_kv_connector.py
    verifies ExampleConnector, dev/gpu/kv_connectors.py ExampleConnector and CPU offload on the GPU); the env variable
    the message names accepts it with a warning. offload: --kv-offloading-backend, with --kv-offloading-size 1."""
    from vllm.config import KVTransferConfig

    from vllm_msa.config import UNVERIFIED_KV_CONNECTORS_ENV, _check_kv_connectors

    monkeypatch.delenv(UNVERIFIED_KV_CONNECTORS_ENV, raising=False)
    transfer_config = transfer and KVTransferConfig(kv_role="kv_both", **transfer)
    cache = SimpleNamespace(kv_offloading_size=offload and 1.0, kv_offloading_backend=offload)
    vllm_config = SimpleNamespace(kv_transfer_config=transfer_config, cache_config=cache)
    if refused is None:
        _check_kv_connectors(vllm_config)
        return
    with pytest.raises(MSAConfigError, match=refused + ", which is not verified to carry FLASH_MSA's caches"):
        _check_kv_connectors(vllm_config)
    name = refused.split("KV connector ")[1]
    monkeypatch.setenv(UNVERIFIED_KV_CONNECTORS_ENV, f"ExampleConnector, {name}")
    _check_kv_connectors(vllm_config)


@pytest.mark.parametrize(
    "pages, spec, connector, refused",
    [
        (None, None, None, None),  # no tier: nothing checked
        (64, None, None, None),  # 4 requests x Hi 4 x top-4
        (0, None, None, "N is the device pages of each MSA layer, a positive integer, not 0"),
        ("64", None, None, "a positive integer, not '64'"),
        (63, None, None, r"63 device pages cannot hold one decode step's pages: --max-num-seqs 4 requests x 4 index"),
        (64, {"method": "ngram"}, None, "does not run speculative decoding yet"),
        (64, None, "ExampleConnector", r"does not run KV connectors yet \(ExampleConnector\)"),
    ],
)
def test_a_host_tier_flash_msa_cannot_serve_is_refused_by_name(pages, spec, connector, refused):
    from vllm.config import KVTransferConfig

    from vllm_msa.config import KV_DEVICE_PAGES_OPTION, check_kv_device_pages

    shape = MSAModelConfig.from_hf_config(_HF(msa_config=MSA)).layer_shape(_HF(msa_config=MSA))
    vllm_config = SimpleNamespace(
        additional_config={} if pages is None else {KV_DEVICE_PAGES_OPTION: pages},
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        speculative_config=spec,
        kv_transfer_config=connector and KVTransferConfig(kv_role="kv_both", kv_connector=connector),
        cache_config=SimpleNamespace(kv_offloading_size=None),
    )
    if refused is None:
        check_kv_device_pages(vllm_config, shape)
        return
    with pytest.raises(MSAConfigError, match=refused):
        check_kv_device_pages(vllm_config, shape)


def test_host_tiers_past_the_host_memory_are_refused_by_name_before_any_is_allocated():
    """The first MSA layer to allocate its tier checks the host memory all the model's tiers will take: pages that
    one layer's tier fits but twenty do not are refused, naming the page count that fits."""
    import psutil

    from vllm_msa.host_tier import HOST_MEMORY_SHARE, LayerHostTier, page_bytes

    shape = MSAModelConfig.from_hf_config(_HF(msa_config=MSA)).layer_shape(_HF(msa_config=MSA))
    pages = int(HOST_MEMORY_SHARE * psutil.virtual_memory().available / page_bytes(shape, torch.bfloat16) / 10)
    with pytest.raises(MSAConfigError, match=r"the K/V of 20 MSA layers .* --num-gpu-blocks-override at most \d+ "):
        LayerHostTier.allocate(pages, 64, shape, torch.bfloat16, torch.device("cpu"), layers_to_allocate=20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_device_tier_past_the_free_gpu_memory_is_refused_by_name():
    """The host tier's device pages are allocated beside vLLM's KV budget: more than the GPU has free is refused
    naming the option and the flags that leave room, before anything is allocated."""
    from vllm_msa.host_tier import LayerHostTier, page_bytes

    shape = MSAModelConfig.from_hf_config(_HF(msa_config=MSA)).layer_shape(_HF(msa_config=MSA))
    device = torch.device("cuda")
    too_many = torch.cuda.mem_get_info(device)[0] // page_bytes(shape, torch.bfloat16) + 1
    with pytest.raises(MSAConfigError, match=f"device tier of {too_many} pages.*lower flash_msa_kv_device_pages"):
        LayerHostTier.allocate(4, too_many, shape, torch.bfloat16, device)
    tier = LayerHostTier.allocate(4, 64, shape, torch.bfloat16, device)
    assert tier.device_pages.shape[0] == 64 and tier.host_pages.is_pinned()


@pytest.mark.parametrize(
    "capability, importable, reason",
    [
        ((8, 0), True, "the CuTeDSL kernels run on Hopper GPUs \\(compute capability 9.0\\), this GPU is 8.0"),
        ((10, 0), True, "this GPU is 10.0"),
        ((9, 0), True, "do not serve head_dim 64 / index_head_dim 32 with 128-token blocks in torch.float16"),
        ((9, 0), False, None),
    ],
)
def test_the_start_up_warning_says_why_a_gpu_runs_the_pytorch_path(capability, importable, reason, monkeypatch):
    """Another GPU than Hopper (FP8 caches included: no FP8 path of the kernels runs there) is named by its compute
    capability; on Hopper the shape or dtype is; where CuTeDSL does not import, ops has warned already."""
    from msa_kernels import ops
    from msa_kernels.shapes import MSAShape

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ops, "_on_hopper", lambda device: capability == (9, 0) and importable)
    shape = MSAShape(8, 2, 64, 2, 1, 32, 4)
    got = ops.unserved_reason(torch.device("cuda", 0), torch.float16, shape)
    if reason is None:
        assert got is None
    else:
        assert re.search(reason, got), got


def test_fp8_index_key_pages_budget_values_and_scales():
    from vllm_msa.index_key_cache import index_key_cache_spec

    bf16 = index_key_cache_spec(1, 128, 128, torch.bfloat16)
    fp8 = index_key_cache_spec(1, 128, 128, Fp8IndexKeyCache.dtype)
    assert bf16.page_size_bytes == 128 * 128 * 2
    assert fp8.page_size_bytes == 128 * (128 + 4) and fp8.dtype == torch.uint8  # e4m3 values, float32 scale
    assert index_key_cache_spec(2, 32, 128, Fp8IndexKeyCache.dtype).page_size_bytes == 128 * 2 * (32 + 4)


def test_demo_checkpoint_is_sparse_at_2k_tokens(demo_model):
    config = json.loads((demo_model / "config.json").read_text())
    msa = config["msa_config"]
    assert config["architectures"] == ["FlashMSAForCausalLM"]
    assert msa["topk_blocks"] * msa["block_size"] < 2048  # a 2K prompt spans more blocks than k


def test_msa_op_is_where_piecewise_cuda_graphs_split_like_vllm_attention_ops():
    """The MSA op reads host-side batch layout each step: it must run between captured graph pieces."""
    from vllm.config.compilation import CompilationConfig, CompilationMode

    import vllm_msa

    vllm_msa.register()
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    config.set_splitting_ops_for_v1(all2all_backend="naive")
    assert "vllm::unified_attention_with_output" in config.splitting_ops
    assert "vllm_msa::msa_attention" in config.splitting_ops


def test_m3_attention_demo_preset_has_minimax_m3_layer_shapes():
    from types import SimpleNamespace

    from msa_kernels.shapes import M3_SHAPE
    from serve.build_demo_model import PRESETS
    from vllm_msa.checkpoint import make_config

    hf = SimpleNamespace(**make_config(**PRESETS["m3-attention"]))
    shape = MSAModelConfig.from_hf_config(hf).layer_shape(hf)
    assert shape == M3_SHAPE  # the preset has MiniMax-M3's attention shapes, as the benchmarks use them


def test_metrics_count_no_padding_tokens(monkeypatch):
    import torch

    from vllm_msa.metrics import COUNTERS, DIR_ENV, StepStats

    monkeypatch.delenv(DIR_ENV, raising=False)  # no metrics file: this process's /metrics stays as it is

    selected = torch.tensor([[[0, 2, -1]], [[0, 1, -1]], [[0, 1, 3]]], dtype=torch.int32)
    positions = torch.tensor([300, 200, 400])
    plain, padded, mixed = (StepStats(torch.device("cpu"), "m") for _ in range(3))
    plain.record(selected, positions, 128, decode_tokens=3)
    # the same decode step replayed from a full CUDA graph: padding tokens follow the real ones
    padded.record(
        torch.cat([selected, torch.full((3, 1, 3), -1, dtype=torch.int32)]),
        torch.cat([positions, torch.full((3,), -1)]),
        128,
        decode_tokens=6,
    )
    assert torch.equal(plain.totals, padded.totals)
    mixed.record(selected, positions, 128, decode_tokens=2)  # the last token in the step's prefill part
    counted = [dict(zip(COUNTERS, stats.totals.tolist())) for stats in (plain, mixed)]
    assert [(c["selections"], c["decode_selections"]) for c in counted] == [(3, 3), (3, 2)]


@pytest.mark.parametrize("speculative_tokens, threshold, decode_lens", [(None, 1, []), (3, 4, [4, 1, 3])])
def test_builder_counts_speculative_verification_requests_as_decodes(
    demo_model, speculative_tokens, threshold, decode_lens
):
    """FLASH_MSA's metadata builder under vLLM's config: with n-gram speculation of 3 tokens, requests with up
    to 4 new tokens (verification, or fewer drafts) form the decode part; without it, one new token."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata

    import vllm_msa
    from msa_kernels.shapes import MSAShape
    from vllm_msa.backend import FlashMSAMetadataBuilder
    from vllm_msa.layer import kv_cache_spec

    vllm_msa.register()
    speculative_config = speculative_tokens and {"method": "ngram", "num_speculative_tokens": speculative_tokens}
    vllm_config = EngineArgs(
        model=str(demo_model), attention_backend="FLASH_MSA", dtype="float32", speculative_config=speculative_config
    ).create_engine_config()
    spec = kv_cache_spec(MSAShape(8, 2, 32, 4, 1, 32, 4), torch.float32)
    builder = FlashMSAMetadataBuilder(spec, ["model.layers.1.self_attn.attn"], vllm_config, torch.device("cpu"))
    # decodes first as vLLM orders them: 1 + 3 drafts, no draft, 1 + 2 drafts; then two prompt chunks
    q_lens, seq_lens = [4, 1, 3, 45, 17], [37, 80, 300, 45, 60]
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    metadata = builder.build(
        0,
        CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(q_lens),
            num_actual_tokens=sum(q_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=torch.zeros(len(q_lens), 3, dtype=torch.int32),
            slot_mapping=torch.arange(sum(q_lens)),
        ),
    )
    decode, prefill = metadata.plan.part("decode"), metadata.plan.part("prefill")
    assert builder.reorder_batch_threshold == threshold
    assert (decode.batch.query_lens_cpu if decode else []) == decode_lens
    assert prefill is not None and prefill.batch.query_lens_cpu == q_lens[len(decode_lens) :]


def test_tensor_parallel_ranks_hold_the_heads_their_query_heads_need():
    hf = _HF(msa_config=MSA)  # Hq 8, Hkv 2, Hi 4, Hki 1
    msa = MSAModelConfig.from_hf_config(hf)
    for tp in (1, 2, 4, 8):
        layouts = [msa.rank_layout(hf, tp, rank) for rank in range(tp)]
        for rank, layout in enumerate(layouts):
            s = layout.shape
            q_heads = range(rank * 8 // tp, (rank + 1) * 8 // tp)
            assert s.num_q_heads == len(q_heads)
            assert {h // 2 for h in q_heads} == set(layout.index_heads)  # index head p serves q heads 2p, 2p+1
            assert s.num_kv_heads == max(1, 2 // tp) and list(layout.index_key_heads) == [0]
        # every index head is counted by exactly one rank (replicas at TP 8 count once)
        counted = [h for layout in layouts if layout.counts_selections for h in layout.index_heads]
        assert sorted(counted) == [0, 1, 2, 3], tp
    assert msa.rank_layout(hf, 2, 1).describe(2) == "per rank of 2: Hq 4, Hkv 1, index heads 2, index key heads 1"


@pytest.mark.parametrize(
    "tp, message",
    [
        (3, "num_attention_heads 8 is not divisible by --tensor-parallel-size 3"),
        (16, "num_attention_heads 8 is not divisible by --tensor-parallel-size 16"),
    ],
)
def test_tensor_parallel_sizes_the_heads_cannot_follow_are_refused_by_name(tp, message):
    hf = _HF(msa_config=MSA)
    with pytest.raises(MSAConfigError, match=message):
        MSAModelConfig.from_hf_config(hf).rank_layout(hf, tp, 0)
    hf = _HF(num_attention_heads=12, num_key_value_heads=3, msa_config=MSA | {"num_index_heads": 6})
    with pytest.raises(MSAConfigError, match="num_key_value_heads 3 is not divisible by --tensor-parallel-size 2"):
        MSAModelConfig.from_hf_config(hf).rank_layout(hf, 2, 0)


def test_sizing_reads_the_cache_specs_vllm_allocates(demo_model):
    from vllm_msa import sizing

    text, msa, m3 = sizing.load(demo_model)
    assert not m3
    # bf16: K/V 2 x Hkv 2 x D 32 x 2 B in 4 layers; index keys Dp 32 x 2 B in the 3 MSA layers
    assert sizing.cache_bytes_per_token(text, msa, range(4), tp=1) == (4 * 256, 3 * 64)
    assert sizing.cache_bytes_per_token(text, msa, range(4), tp=2) == (4 * 128, 3 * 64)  # 1 KV head per rank
    fp8 = sizing.cache_bytes_per_token(text, msa, range(4), tp=1, indexer_kv_dtype="fp8")
    assert fp8 == (4 * 256, 3 * 36)  # e4m3 index keys + a float32 scale per token
    report = sizing.size(
        demo_model, sizing.Layout(tp=2), gpu_gib=1.0, utilization=0.5, weight_dtype="bf16", contexts=[4096]
    )
    assert "per rank of 2: Hq 4, Hkv 1, index heads 2, index key heads 1" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kv_pages_written_on_cuda_hold_the_reference_bytes():
    """backend.write_paged on CUDA (vLLM's reshape_and_cache_flash with the layer's scale tensors) against the
    reference's e4m3 of K / k_scale and V / v_scale, byte for byte; slots < 0 skipped, NaN kept (as a NaN: vLLM's
    kernel writes 0x7f where torch's CPU cast writes 0xff, both e4m3 NaN)."""
    from vllm_msa.backend import write_paged

    rows, heads, dim, pages, block = 300, 2, 128, 6, 128
    g = torch.Generator().manual_seed(11)
    key, value = (torch.randn(rows, heads, dim, generator=g) * 200 for _ in range(2))  # some saturate at 448
    key[3, 0, 5] = float("nan")
    slots = torch.randperm(pages * block, generator=g)[:rows]
    slots[::7] = -1
    caches = {}
    for device in ("cpu", "cuda"):
        # an MSA layer's FP8 scales, as vLLM's attention layers hold them (powers of two: exact either way)
        layer = SimpleNamespace(
            _k_scale=torch.tensor(2.0, device=device),
            _v_scale=torch.tensor(0.25, device=device),
            _k_scale_float=2.0,
            _v_scale_float=0.25,
        )
        cache = torch.zeros(pages, 2, block, heads, dim, dtype=FP8_KV_STORAGE, device=device)
        bf16 = (key.bfloat16().to(device), value.bfloat16().to(device))
        write_paged(cache[:, 0], cache[:, 1], slots.to(device), *bf16, layer)
        caches[device] = cache.cpu()
    nan = {device: cache.view(torch.float8_e4m3fn).float().isnan() for device, cache in caches.items()}
    assert torch.equal(nan["cuda"], nan["cpu"]) and nan["cpu"].sum() == 1
    assert torch.equal(caches["cuda"][~nan["cuda"]], caches["cpu"][~nan["cpu"]])
