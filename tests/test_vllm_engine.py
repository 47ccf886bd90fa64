"""FLASH_MSA inside real vLLM engines (CPU, LLM class, greedy) on the demo checkpoint.

Each engine runs once per module (they take ~40 s to start here) and the tests compare their tokens:
  dense       every layer dense, vLLM's own CPU attention backend
  msa_full_k  FLASH_MSA with top-k covering every block: must equal dense
  msa         FLASH_MSA, demo top-k (4 of up to 24 blocks), prefix caching + chunked prefill (512)
  msa_plain   same model, prefix caching off, chunked prefill off
"""

import json
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
def msa_tokens(demo_model, prompts):
    """Runs the batch twice in one engine: the second pass is served from the prefix cache."""
    with engine(demo_model, enable_prefix_caching=True, max_num_batched_tokens=512) as llm:
        first = greedy(llm, prompts)
        second = greedy(llm, prompts)
    return first, second


@pytest.fixture(scope="module")
def msa_plain_tokens(demo_model, prompts):
    with engine(demo_model, enable_prefix_caching=False, enable_chunked_prefill=False,
                max_num_batched_tokens=4096) as llm:
        return greedy(llm, prompts)


def test_topk_covering_all_blocks_equals_vllm_dense_backend(dense_tokens, msa_full_k_tokens):
    assert msa_full_k_tokens == dense_tokens


def test_small_k_is_sparse_and_matches_the_reference_model(demo_model, prompts, msa_tokens, dense_tokens):
    tokens, _ = msa_tokens
    reference = ReferenceFlashMSA(demo_model)
    for prompt, got in zip(prompts, tokens):
        assert got == reference.greedy(prompt, MAX_TOKENS), len(prompt)
    # Up to 4 blocks (512 tokens) every layer is dense; past that MSA must change the output.
    for prompt, sparse, dense in zip(prompts, tokens, dense_tokens):
        if len(prompt) + MAX_TOKENS <= 4 * 128:
            assert sparse == dense, len(prompt)
    assert tokens[0] != dense_tokens[0]


def test_prefix_cache_hits_and_chunked_prefill_give_identical_tokens(msa_tokens, msa_plain_tokens):
    first, second = msa_tokens
    assert second == first  # every prompt now hits the prefix cache
    assert first == msa_plain_tokens  # no prefix caching, no chunking
