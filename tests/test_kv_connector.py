"""Disaggregated prefill on one machine with vLLM's ExampleConnector (issue 38): the pass-key model trained with MSA
(models/needle-msa, what `bash serve/demo.sh` serves) answers after a producer server saved its K/V and index keys to
disk and a consumer server loaded them instead of computing them, as a single server does; the same consumer given
zeroed index keys answers otherwise (the index keys are what lets it find the key among many blocks). With bf16 and
with FP8 index keys (`indexer_kv_dtype` fp8: a page's bytes are its tokens' e4m3 values, then their scales, not one
row per token; ExampleConnector moves whole pages only, so each page arrives intact).

Each prompt is 2048 tokens (16 blocks, top-4 a token) with the key outside the forced last block, prefilled in one
chunk (vLLM's ExampleConnector loads a prompt saved in several chunks with the wrong shape: its own limit).
"""

import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.serving import demo_server
from training.needle_task import PassKeyTask, answer_is_correct, load_tokenizer
from vllm_msa.checkpoint import EOS

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "models" / "needle-msa"
DEPTHS = (0.1, 0.3, 0.5)
KEYS = ("40417", "27182", "31415")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TRAINED / "config.json").is_file(), reason="no trained checkpoint at models/needle-msa"),
]


def _answers(storage: Path, log_dir: Path, prompts: list[list[int]], index_keys: str) -> list[str]:
    """Greedy completions of the prompts from a demo server whose ExampleConnector keeps K/V in `storage`."""
    log_dir.mkdir()
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    flags = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "1G"]
    flags += ["--max-num-batched-tokens", "4096", "--kv-transfer-config", json.dumps(connector)]
    flags += ["--attention-config", json.dumps({"indexer_kv_dtype": index_keys})]
    with demo_server(log_dir, flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        completions = [
            client.completions.create(model="demo-msa", prompt=prompt, max_tokens=8, temperature=0)
            for prompt in prompts
        ]
    return [completion.choices[0].text for completion in completions]


@pytest.mark.parametrize("index_keys", ["bf16", "fp8"])
def test_a_consumer_answers_from_the_producers_kv_and_index_keys(tmp_path, index_keys):
    task = PassKeyTask(load_tokenizer(TRAINED), EOS)
    rng = np.random.default_rng(38)
    prompts = [task.prompt(2048, depth, key, rng).prompt_ids for depth, key in zip(DEPTHS, KEYS)]
    storage = tmp_path / "kv"

    produced = _answers(storage, tmp_path / "producer", prompts, index_keys)
    assert all(answer_is_correct(text, key) for text, key in zip(produced, KEYS)), produced
    saved = sorted({path.name for path in storage.rglob("*.safetensors")})
    index_key_files = [name for name in saved if name.endswith(".index_key_cache.safetensors")]
    # the 3 MSA layers' K/V and index keys, the dense layer's K/V
    assert len(index_key_files) == 3 and len(saved) == 7, saved

    consumer_log = tmp_path / "consumer"
    assert _answers(storage, consumer_log, prompts, index_keys) == produced
    assert (consumer_log / "server.log").read_text().count("Inject KV cache of") == len(prompts)

    for path in storage.rglob("*.index_key_cache.safetensors"):
        saved_keys = load_file(str(path))["kv_cache"]
        save_file({"kv_cache": torch.zeros_like(saved_keys)}, str(path))
    blind = _answers(storage, tmp_path / "zeroed-index-keys", prompts, index_keys)
    assert not all(answer_is_correct(text, key) for text, key in zip(blind, KEYS)), blind
