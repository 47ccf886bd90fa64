"""MiniMax-M3 on FLASH_MSA: checkpoint format, architecture override, config mapping, selections, tokens.

CPU: the tiny checkpoint parses with vLLM's config parser; FLASH_MSA owns vLLM's M3 architecture;
M3's sparse_attention_config maps onto MSAShape (and what FLASH_MSA cannot serve is refused); the
serving check acts only under FLASH_MSA; vLLM's own M3 indexer kernels (Triton, run by Triton's
interpreter) select the same blocks as msa_kernels.reference on the same paged inputs.
GPU (skipped without CUDA): the same selection check with real Triton against msa_kernels.ops, and
vLLM's own M3 path vs the FLASH_MSA path, both with vLLM's CUDA graphs, on the M3-attention-shaped
checkpoint (serve/build_m3_model.py --preset m3-attention; vLLM's own M3 engine died with an
illegal memory access on the tiny one, 2026-12-02): model classes, weight coverage, greedy tokens
and their logprobs (a differing token must be one that bf16 cannot decide: see the test).

    python3 -m pytest -q tests/test_minimax_m3.py
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from msa_kernels import ops, reference
from msa_kernels.plan import StepPlan
from msa_kernels.shapes import MSAShape, PagedBatch
from serve.build_m3_model import PRESETS, build_m3_model, make_config
from vllm_msa.config import (
    KV_DEVICE_PAGES_OPTION,
    MSAConfigError,
    MSAModelConfig,
    check_minimax_m3_serving_config,
    index_key_dtype,
    m3_fused_op_writes_caches,
    served_indexer_kv_dtype,
)

ROOT = Path(__file__).resolve().parents[1]
ARCH = "MiniMaxM3SparseForCausalLM"
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def m3_model(tmp_path_factory):
    return build_m3_model(tmp_path_factory.mktemp("models") / "tiny-m3")


@pytest.fixture(scope="module")
def text_config(m3_model):
    from vllm.transformers_utils.config import get_config

    return get_config(str(m3_model), trust_remote_code=False).get_text_config()


# The text-config classes vLLM has read M3 checkpoints with: its own (vLLM 0.32: the checkpoint's
# sparse_attention_config kept as is) and transformers' (vLLM 0.34: flattened into index_* and layer_types).
SCHEMAS = {
    "vllm": ("vllm.transformers_utils.configs.minimax_m3", "MiniMaxM3TextConfig"),
    "transformers": ("transformers", "MiniMaxM3VLTextConfig"),
}


def text_config_class(schema):
    module, name = SCHEMAS[schema]
    cls = getattr(importlib.import_module(module), name, None) if importlib.util.find_spec(module) else None
    if cls is None:
        pytest.skip(f"{module}.{name} is not in this vLLM / transformers")
    return cls


def m3_text_config(schema="vllm", **overrides):
    return text_config_class(schema)(**make_config(**overrides)["text_config"])


# ---------------------------------------------------------------------------------------------- CPU


def test_checkpoint_parses_as_minimax_m3_and_names_every_layer_part(m3_model, text_config):
    from safetensors import safe_open
    from transformers import AutoTokenizer
    from vllm.transformers_utils.config import get_config

    config = get_config(str(m3_model), trust_remote_code=False)
    assert type(config).__name__ in ("MiniMaxM3Config", "MiniMaxM3VLConfig") and config.architectures == [ARCH]
    assert type(text_config).__name__ in ("MiniMaxM3TextConfig", "MiniMaxM3VLTextConfig")
    assert (text_config.num_attention_heads, text_config.num_key_value_heads, text_config.head_dim) == (32, 2, 128)
    with safe_open(m3_model / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {
        "model.layers.3.self_attn.index_q_proj.weight",
        "model.layers.3.self_attn.index_k_norm.weight",
        "model.layers.4.block_sparse_moe.experts.7.w2.weight",
        "model.layers.0.mlp.gate_proj.weight",
    } <= names
    assert not any(n.startswith("model.layers.2.") and ".index_" in n for n in names), "dense layer with index weights"
    assert AutoTokenizer.from_pretrained(m3_model).vocab_size == text_config.vocab_size


def test_mtp_modules_are_sparse_moe_layers_under_the_names_vllms_mtp_loader_maps(tmp_path):
    from safetensors import safe_open
    from vllm.transformers_utils.config import get_config

    model = build_m3_model(tmp_path / "tiny-m3-mtp", num_mtp_modules=1)
    assert get_config(str(model), trust_remote_code=False).get_text_config().num_mtp_modules == 1
    with safe_open(model / "model.safetensors", "pt") as f:
        names = set(f.keys())
        eh_proj = f.get_slice("model.mtp.layers.0.eh_proj.weight").get_shape()
    mtp = {n.removeprefix("model.mtp.layers.0.") for n in names if n.startswith("model.mtp.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"} <= mtp
    assert eh_proj == [256, 512]  # [hidden, 2 x hidden]: the embedding and the previous hidden state joined
    layer = {n.removeprefix("transformer_layer.") for n in mtp if n.startswith("transformer_layer.")}
    sparse_moe = {n.removeprefix("model.layers.4.") for n in names if n.startswith("model.layers.4.")}
    assert layer == sparse_moe  # the same parts as a sparse MoE layer of the target


def test_flash_msa_owns_vllms_m3_architecture_and_its_config_hook():
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import vllm_msa

    vllm_msa.register()
    vllm_msa.register()  # vLLM loads plugins more than once per process: the hooks chain once
    entry = ModelRegistry.models[ARCH]
    assert (entry.module_name, entry.class_name) == ("vllm_msa.models.minimax_m3", "FlashMSAMiniMaxM3ForCausalLM")
    for arch in (ARCH, "MiniMaxM3SparseForConditionalGeneration"):
        hook = MODELS_CONFIG_MAP[arch]
        assert hook.msa_check is check_minimax_m3_serving_config, arch
        assert getattr(hook.__mro__[1], "msa_check", None) is None, f"{arch}: FLASH_MSA's check chained twice"


@pytest.mark.parametrize("schema", SCHEMAS)
def test_m3_sparse_attention_config_maps_onto_msa_shape(schema):
    text_config = m3_text_config(schema)
    msa = MSAModelConfig.from_minimax_m3(text_config)
    assert msa.dense_layers == (0, 1, 2) and msa.sparse_layers(5) == [3, 4]
    assert msa.layer_shape(text_config) == MSAShape(
        num_q_heads=32,
        num_kv_heads=2,
        head_dim=128,
        num_index_heads=2,
        num_index_key_heads=1,
        index_head_dim=128,
        topk_blocks=4,
        local_blocks=1,
        init_blocks=0,
        block_size=128,
    )
    production = m3_text_config(schema, **PRESETS["production"])  # the released MiniMax-M3's shapes
    msa = MSAModelConfig.from_minimax_m3(production)
    shape = msa.layer_shape(production)
    assert (shape.num_q_heads, shape.num_kv_heads, shape.num_index_heads, shape.heads_per_index_head) == (64, 4, 4, 16)
    assert (shape.topk_blocks, shape.local_blocks, shape.init_blocks, shape.block_size) == (16, 1, 0, 128)
    assert msa.dense_layers == (0, 1, 2) and msa.sparse_layers(60) == list(range(3, 60))
    # TP 8 on 4 KV heads: vLLM's fused M3 projection gives each rank 8 query heads and the index head of its
    # replicated KV head (ranks 2h and 2h + 1 hold head h) and replicates the one index key.
    layouts = [msa.rank_layout(production, 8, rank) for rank in range(8)]
    assert {
        (s.num_q_heads, s.num_kv_heads, s.num_index_heads, s.num_index_key_heads)
        for s in (layout.shape for layout in layouts)
    } == {(8, 1, 1, 1)}
    assert [layout.index_heads for layout in layouts] == [range(r // 2, r // 2 + 1) for r in range(8)]
    assert all(layout.index_key_heads == range(1) for layout in layouts)
    assert [layout.counts_selections for layout in layouts] == [True, False] * 4  # one replica of each index head


@pytest.mark.parametrize(
    "overrides, messages",  # message per schema; None: transformers' config drops the field
    [
        ({"sparse_score_type": "mean"}, ("sparse_score_type 'mean'", None)),
        ({"sparse_local_block": 0}, ("sparse_local_block must be >= 1", "index_local_blocks must be >= 1")),
        (
            {"sparse_num_index_heads": 4},
            ("sparse_num_index_heads 4 != num_key_value_heads 2", "index_n_heads 4 != num_key_value_heads 2"),
        ),
        ({"sparse_topk_blocks": 0}, ("topk_blocks 0 < local_blocks 1", "topk_blocks 0 < local_blocks 1")),
    ],
)
@pytest.mark.parametrize("schema", SCHEMAS)
def test_m3_configs_flash_msa_cannot_serve_are_refused(schema, overrides, messages):
    message = messages[list(SCHEMAS).index(schema)]
    if message is None:
        pytest.skip(f"the {schema} config has no such field")
    with pytest.raises(MSAConfigError, match=message):
        MSAModelConfig.from_minimax_m3(m3_text_config(schema, sparse_attention_config=overrides))


def serving_config(text_config, backend, block_size=None, tensor_parallel_size=1, indexer_kv_dtype="auto"):
    """The parts of a VllmConfig the check reads (vLLM cannot build a whole M3 VllmConfig on CPU), FLASH_MSA
    registered."""
    from vllm.config import CacheConfig
    from vllm.config.attention import AttentionConfig

    import vllm_msa

    vllm_msa.register()

    cache = CacheConfig() if block_size is None else CacheConfig(block_size=block_size)
    cache.user_specified_block_size = block_size is not None
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text_config),
        cache_config=cache,
        # vLLM's ParallelConfig refuses a TP size above the GPU count: only the TP size is read
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size),
        attention_config=AttentionConfig(backend=backend, indexer_kv_dtype=indexer_kv_dtype),
        kv_transfer_config=None,  # no KV connector (VllmConfig's default)
        additional_config={},  # no host tier (VllmConfig's default)
    )


def test_m3_serving_check_acts_only_under_flash_msa(text_config):
    untouched = serving_config(text_config, None, block_size=16, tensor_parallel_size=2)
    check_minimax_m3_serving_config(untouched)  # vLLM's own path: nothing checked, nothing changed
    assert untouched.cache_config.block_size == 16
    pinned = serving_config(text_config, "FLASH_MSA")
    check_minimax_m3_serving_config(pinned)
    assert pinned.cache_config.block_size == 128
    with pytest.raises(MSAConfigError, match="--block-size 128"):
        check_minimax_m3_serving_config(serving_config(text_config, "FLASH_MSA", block_size=16))
    for tp in (2, 4):  # Hkv = Hi = 2: split at TP 2, replicated at TP 4
        check_minimax_m3_serving_config(serving_config(text_config, "FLASH_MSA", tensor_parallel_size=tp))
    with pytest.raises(MSAConfigError, match="num_attention_heads 32 is not divisible by --tensor-parallel-size 3"):
        check_minimax_m3_serving_config(serving_config(text_config, "FLASH_MSA", tensor_parallel_size=3))


def test_m3_under_flash_msa_honours_vllms_indexer_kv_dtype_option(text_config):
    """vLLM's M3 reads `--attention-config '{"indexer_kv_dtype": ...}'` (auto: bf16); so does FLASH_MSA."""
    msa = MSAModelConfig.from_minimax_m3(text_config)
    for option, served in (("auto", "auto"), ("bf16", "bf16"), ("fp8", "fp8")):
        config = serving_config(text_config, "FLASH_MSA", indexer_kv_dtype=option)
        check_minimax_m3_serving_config(config)
        assert served_indexer_kv_dtype(config, msa) == served
    refused = serving_config(text_config, "FLASH_MSA", indexer_kv_dtype="nvfp4")
    with pytest.raises(MSAConfigError, match="--attention-config indexer_kv_dtype 'nvfp4' is not served"):
        check_minimax_m3_serving_config(refused)
    check_minimax_m3_serving_config(serving_config(text_config, None, indexer_kv_dtype="nvfp4"))  # vLLM's own M3


def test_m3_fused_op_writes_bf16_caches_only(text_config):
    """vLLM's fused M3 op inserts K/V and index keys into bf16 caches only: FLASH_MSA's FP8 index-key pages (which
    the op takes for its NVFP4 ones and refuses at start-up) and an FP8 K/V cache (the checkpoint's scales) keep
    FLASH_MSA's writes."""
    msa = MSAModelConfig.from_minimax_m3(text_config)
    for option, op_writes in (("auto", True), ("bf16", True), ("fp8", False)):
        config = serving_config(text_config, "FLASH_MSA", indexer_kv_dtype=option)
        dtype = index_key_dtype(served_indexer_kv_dtype(config, msa), torch.bfloat16)
        assert m3_fused_op_writes_caches("auto", dtype) == op_writes, option
        assert not m3_fused_op_writes_caches("fp8", dtype), option


def vllm_index_ops(monkeypatch):
    """vLLM's M3 indexer kernels (common/ops/index_topk.py): compiled on CUDA, Triton's interpreter on CPU."""
    if CUDA:
        from vllm.models.minimax_m3.common.ops import index_topk

        return index_topk
    import triton
    import vllm.triton_utils

    # vLLM disables Triton without a GPU; its kernels still run, unchanged, in Triton's interpreter.
    monkeypatch.setattr(vllm.triton_utils, "triton", triton)
    monkeypatch.setattr(vllm.triton_utils, "tl", triton.language)
    path = Path(vllm.__file__).parent / "models/minimax_m3/common/ops/index_topk.py"
    spec = importlib.util.spec_from_file_location("vllm_m3_index_topk_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the package __init__ imports CUDA-only ops, so load the file alone
    for kernel in (module._topk_index_kernel, module._topk_index_partial_kernel):
        kernel.fn.configs = [c for c in kernel.fn.configs if c.kwargs["BLOCK_SIZE_K"] == 128][:1]  # no benchmarker
    return module


def paged_index_inputs(seq_lens, query_lens, num_heads, dim, device, seed):
    """Random bf16 index queries and a paged index-key cache with a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // 128) for n in seq_lens]
    num_pages = sum(blocks) + 3
    pages = torch.randperm(num_pages, generator=gen)[: sum(blocks)].to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for r, row in enumerate(pages.split(blocks)):
        table[r, : len(row)] = row
    cache = torch.randn(num_pages, 128, dim, generator=gen).to(torch.bfloat16)
    index_q = torch.randn(sum(query_lens), num_heads, dim, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = PagedBatch(
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_table=table.to(device),
    )
    return index_q.to(device), cache.to(device), batch


def assert_same_blocks(ours, vllms, scores, what):
    """Equal block sets per (token, head); a difference is allowed only as a swap between tied scores."""
    vllms = vllms.permute(1, 0, 2).long()  # vLLM: [heads, tokens, k], best first; ours: [tokens, heads, k], ascending
    none = scores.shape[-1]

    def canonical(selection):
        return torch.where(selection < 0, none, selection.long()).sort(-1).values

    differ = (canonical(ours) != canonical(vllms)).any(-1).nonzero().tolist()
    for t, h in differ:
        swapped = sorted(set(ours[t, h].tolist()) ^ set(vllms[t, h].tolist()))
        values = scores[t, h, swapped].float()
        assert -1 not in swapped and (values.max() - values.min()) <= 1e-3 * max(1.0, values.abs().max().item()), (
            f"{what}: token {t} head {h}: FLASH_MSA {ours[t, h].tolist()} vs vLLM {vllms[t, h].tolist()}; "
            f"differing blocks {swapped} score {values.tolist()} (not a tie)"
        )
    assert len(differ) <= 0.01 * ours.shape[0] * ours.shape[1], f"{what}: {len(differ)} tie swaps"


SELECTION_CASES = {  # name: (seq_lens, prefill query lens, topk, init, local)
    "m3": ([700, 300, 1000, 129], [8, 5, 3, 1], 4, 0, 1),
    "init+local": ([1000, 520], [6, 4], 5, 1, 2),
}
if CUDA:  # real Triton: whole prompts and chunks, M3's top-16
    SELECTION_CASES = {
        "m3": ([5000, 2100, 300, 129], [5000, 700, 300, 1], 16, 0, 1),
        "topk4": ([3000, 1500], [3000, 1500], 4, 0, 1),
        "init+local": ([4000, 1000], [1000, 1000], 8, 1, 2),
    }


@pytest.mark.parametrize("case", SELECTION_CASES)
def test_topk_blocks_equal_vllms_m3_indexer(case, monkeypatch):
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when first imported
        test = f"{__file__}::test_topk_blocks_equal_vllms_m3_indexer[{case}]"
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            cwd=ROOT,
            env=dict(os.environ, TRITON_INTERPRET="1"),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert out.returncode == 0, out.stdout[-6000:]
        return
    seq_lens, query_lens, topk, init, local = SELECTION_CASES[case]
    device = "cuda" if CUDA else "cpu"
    m3 = vllm_index_ops(monkeypatch)
    heads, dim = 2, 128
    shape = MSAShape(
        num_q_heads=16 * heads,
        num_kv_heads=heads,
        head_dim=128,
        num_index_heads=heads,
        num_index_key_heads=1,
        index_head_dim=dim,
        topk_blocks=topk,
        local_blocks=local,
        init_blocks=init,
        block_size=128,
    )
    for what, q_lens in (("prefill", query_lens), ("decode", [1] * len(seq_lens))):
        index_q, cache, batch = paged_index_inputs(seq_lens, q_lens, heads, dim, device, seed=len(what))
        scores = ops.index_block_scores(
            index_q, cache.unsqueeze(2), StepPlan.of(batch), shape
        )  # FLASH_MSA's index pass
        ours = reference.topk_blocks(scores, batch.positions, shape)
        seq = batch.seq_lens
        if not CUDA:  # Triton 3.6's interpreter misreads bf16; the same (bf16-valued) inputs in float32
            index_q, cache = index_q.float(), cache.float()
        if what == "prefill":
            context = seq - torch.tensor(q_lens, dtype=torch.int32, device=device)
            vllm_scores = m3.minimax_m3_index_score(
                index_q,
                cache,
                batch.block_table,
                batch.query_start_loc,
                seq,
                context,
                max(q_lens),
                max(seq_lens),
                heads,
            )
            vllms = m3.minimax_m3_index_topk(
                vllm_scores, batch.query_start_loc, context, max(q_lens), topk, init, local
            )
        else:
            vllms = m3.minimax_m3_index_decode(
                index_q, cache, batch.block_table, seq, max(seq_lens), topk, init, local, heads, 1, 1
            )
        assert_same_blocks(ours, vllms, scores, f"{case} {what}")


# ---------------------------------------------------------------------------------------------- GPU

PROMPT_LENS = [6000, 2500, 300, 7]  # 47, 20, 3, 1 blocks against top-16
MAX_TOKENS = 16
RESULT = "ENGINE RESULT "  # marks the engine process's result line on stdout
NEAR_TIE = 0.05  # vLLM's top-2 logprobs closer than this: either token is a faithful greedy pick
LOGPROB_TOLERANCE = 0.1  # |ours - vLLM's| logprob of a shared greedy token (bf16 kernels: ~0.03 measured)


def run_engine(model_dir, flash_msa: bool, compare_to: Path | None = None, device_pages: int | None = None) -> dict:
    """Generate in a fresh process: vLLM's own M3 (plugin not loaded) or FLASH_MSA, with device_pages: FLASH_MSA
    with the host tier (that many device pages a layer, one request at a time); see _engine_main."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # apply_model ships this module's functions
    )
    if not flash_msa:
        env["VLLM_PLUGINS"] = ""  # no general plugins: vLLM's registry entry for M3 stays vLLM's
    else:  # vLLM finds plugins by their installed entry point, not on PYTHONPATH
        plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
        assert "vllm_msa:register" in plugins, "the vllm_msa plugin is not installed here: pip install --no-deps ."
    args = [sys.executable, __file__, str(model_dir), "FLASH_MSA" if flash_msa else "", str(compare_to or "")]
    args.append(str(device_pages or ""))
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, f"engine failed ({'FLASH_MSA' if flash_msa else 'vLLM'}):\n{out.stderr[-6000:]}"
    [result] = [line[len(RESULT) :] for line in out.stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(result)  # vLLM's engine process may log to stdout after it


def layer_classes(model) -> list[str]:
    return [type(layer.self_attn).__name__ for layer in model.model.layers]


def unused_checkpoint_tensors(model_dir: str, model) -> list[str]:
    """Checkpoint tensors that load into no parameter (vLLM's M3 loader skips unknown names silently)."""
    from safetensors.torch import load_file

    tensors = load_file(Path(model_dir) / "model.safetensors", device="cuda")
    return [name for name, tensor in tensors.items() if not model.load_weights([(name, tensor)])]


def first_difference(mine: list[int], theirs: list[int]) -> int | None:
    return next((step for step, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)


def _engine_main(model_dir: str, backend: str, compare_to: str, device_pages: str) -> None:
    """Greedy tokens of every prompt; with compare_to (the other engine's result), also this engine's own
    two execution paths of the context where the tokens first differ: that context (prompt + the shared
    tokens) prefilled whole, then again as a chunk after its cached prefix blocks. device_pages: the host tier
    with that many device pages a layer, one request at a time."""
    import functools
    import random

    from vllm import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in PROMPT_LENS]
    prompts.append(prompts[0][:3000] + prompts[1][:200])  # shares 23 full blocks with prompt 0: prefix cache
    llm = LLM(
        model=model_dir,
        attention_backend=backend or None,
        # vLLM's own M3 is the reference here: eager, which halves the test's cold compile time on the GPU
        # (two torch.compile runs took ~590 s); FLASH_MSA keeps vLLM's default graphs, which the test checks.
        enforce_eager=not backend,
        block_size=128,
        max_model_len=8192,
        dtype="bfloat16",
        # A fixed KV cache rather than a share of the free memory that vLLM profiles (other GPU work of the
        # same machine, a training run, changes the free memory while the engine starts); vLLM still wants
        # this share of the GPU free at start-up.
        kv_cache_memory_bytes=4 << 30,
        gpu_memory_utilization=0.3,
        seed=0,
        **(
            {"additional_config": {KV_DEVICE_PAGES_OPTION: int(device_pages)}, "max_num_seqs": 1}
            if device_pages
            else {}
        ),
    )
    [model_class] = llm.apply_model(lambda model: f"{type(model).__module__}.{type(model).__name__}")
    [classes] = llm.apply_model(layer_classes)
    cudagraphs = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name

    def generate(tokens: list[int], max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
        return llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0].outputs[0]

    # One prompt at a time, in order: the last one hits the prefix cache of the first.
    outputs = [generate(p, MAX_TOKENS) for p in prompts]
    tokens = [list(o.token_ids) for o in outputs]
    paths = {}
    if compare_to:
        other = json.loads(Path(compare_to).read_text())["tokens"]
        for p, (mine, theirs) in enumerate(zip(tokens, other)):
            if (step := first_difference(mine, theirs)) is not None:
                context = prompts[p] + mine[:step]
                llm.reset_prefix_cache()
                paths[p] = {
                    "step": step,
                    "whole_prefill": generate(context, 1).token_ids[0],
                    "cached_prefix_chunk": generate(context, 1).token_ids[0],
                }
    [unused] = llm.apply_model(functools.partial(unused_checkpoint_tensors, model_dir))  # reloads: after generating
    result = {
        "model_class": model_class,
        "layer_classes": classes,
        "cudagraph_mode": cudagraphs,
        "unused_tensors": unused,
        "tokens": tokens,
        "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.logprobs] for o in outputs],
        "own_paths_at_first_difference": paths,
    }
    print(RESULT + json.dumps(result), flush=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="vLLM's MiniMax-M3 needs CUDA")
def test_flash_msa_m3_greedy_tokens_equal_vllms_own_m3(m3_attention_model, tmp_path):
    ours = run_engine(m3_attention_model, flash_msa=True)
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    theirs = run_engine(m3_attention_model, flash_msa=False, compare_to=tmp_path / "ours.json")
    assert theirs["model_class"] == "vllm.models.minimax_m3.nvidia.model.MiniMaxM3SparseForCausalLM", theirs
    assert ours["model_class"] == "vllm_msa.models.minimax_m3.FlashMSAMiniMaxM3ForCausalLM", ours
    assert theirs["layer_classes"] == ["MiniMaxM3Attention"] + ["MiniMaxM3SparseAttention"] * 3
    assert ours["layer_classes"] == ["MiniMaxM3Attention"] + ["FlashMSAMiniMaxM3Attention"] * 3
    assert ours["cudagraph_mode"] == "FULL_AND_PIECEWISE", ours["cudagraph_mode"]  # full graphs for decode
    assert ours["unused_tensors"] == [] and theirs["unused_tensors"] == [], "checkpoint tensors loaded nowhere"
    # vLLM 0.26.0's own M3 returned NaN logprobs for whole prompts (its top-k buffer layout bug, vLLM
    # issue 48603, fixed in 0.32): on the supported vLLM both sides must be finite everywhere.
    for name, run in (("FLASH_MSA", ours), ("vLLM's own M3", theirs)):
        nan = [p for p, steps in enumerate(run["logprobs"]) if any(v != v for step in steps for v in step.values())]
        assert nan == [], f"{name} gives NaN logprobs on prompts {nan} (lengths {PROMPT_LENS} + shared prefix)"
    # bf16 paths with different kernels. Up to the first differing token both sides must give the same
    # logprobs within bf16 noise. A differing token is a faithful greedy pick only where it cannot be
    # decided in bf16: vLLM's top-2 are a near tie, or vLLM itself picks differently on its own two
    # execution paths of that context (whole prefill vs cached prefix + chunk: bf16 rounding alone flips a
    # near-tied MoE routing decision there, H200 2026-12-03, results/README.md) and one of them picks
    # FLASH_MSA's token; or both of vLLM's own paths of that context pick FLASH_MSA's token, so the
    # difference is vLLM's decode step against its own prefill of the same context (its eager decode
    # did so at a 0.38-nat gap, H200 2026-12-04, results/README.md).
    for p, (mine, vllm_tokens) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        what = f"prompt {p} ({PROMPT_LENS[p] if p < len(PROMPT_LENS) else 'shared prefix'} tokens)"
        step = first_difference(mine, vllm_tokens)
        for s in range(MAX_TOKENS if step is None else step):
            a, b = ours["logprobs"][p][s][str(mine[s])], theirs["logprobs"][p][s][str(mine[s])]
            assert abs(a - b) < LOGPROB_TOLERANCE, f"{what} step {s}: logprob {a} (FLASH_MSA) vs {b} (vLLM)"
        if step is None:
            continue
        top = sorted(theirs["logprobs"][p][step].values(), reverse=True)
        own = theirs["own_paths_at_first_difference"][str(p)]
        own_tokens = {own["whole_prefill"], own["cached_prefix_chunk"]}
        undecidable = top[0] - top[1] < NEAR_TIE or (len(own_tokens) == 2 and mine[step] in own_tokens)
        vllm_prefill_agrees = own_tokens == {mine[step]}
        assert undecidable or vllm_prefill_agrees, (
            f"{what} step {step}: FLASH_MSA {mine} vs vLLM {vllm_tokens}; vLLM's top-2 logprobs {top} are no "
            f"tie and vLLM's own paths of that context pick {own} (FLASH_MSA: {mine[step]})"
        )
    exact = sum(mine == vllm_tokens for mine, vllm_tokens in zip(ours["tokens"], theirs["tokens"]))
    print(
        f"greedy tokens equal on {exact} of the {len(ours['tokens'])} prompts; first differences: "
        f"{theirs['own_paths_at_first_difference']}"
    )


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="vLLM's MiniMax-M3 needs CUDA")
def test_flash_msa_m3_with_the_host_tier_gives_its_tokens_without_it(m3_attention_model):
    """MiniMax-M3 with its MSA layers' K/V in host memory (the host tier: vLLM's M3 fused norm/RoPE op then leaves
    the cache writes to the layer) and a device tier of one request's pages a layer (Hi 4 x top-16 = 64): the same
    greedy tokens as FLASH_MSA without it, decode steps on full CUDA graphs either way."""
    plain = run_engine(m3_attention_model, flash_msa=True)
    tiered = run_engine(m3_attention_model, flash_msa=True, device_pages=64)
    assert tiered["cudagraph_mode"] == plain["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert tiered["tokens"] == plain["tokens"]


if __name__ == "__main__":
    _engine_main(*sys.argv[1:5])
