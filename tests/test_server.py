"""The demo server started exactly as the README says (`bash serve/demo.sh`), queried over the OpenAI API.

One server for the module, on a free loopback port, with the selection-log debug option on, in
float32 (in bf16 a prefill of 92 tokens and one of 1500 round differently, so a prefix-cache hit can
flip a near-tied greedy token; the engine tests run float32 too). It must
answer good requests, turn bad ones into clear 4xx errors and keep serving, abort the requests of
clients that went away, export the sparse layers' metrics on its real /metrics, log the blocks it
selects for a marked request (the same on a prefix-cache hit as on a miss), and pass a bounded soak
(locust) with zero failed requests and flat memory.
"""

import json
import random
import re
import time
from pathlib import Path

import openai
import pytest
import requests

from loadtests.run_load import run as run_load_test
from serve.local_server import healthy
from tests.serving import demo_server
from vllm_msa.checkpoint import DEFAULT_CONFIG
from vllm_msa.metrics import SAMPLE_EVERY

pytestmark = pytest.mark.slow

MODEL = "demo-msa"
SERVER_FLAGS = ["--dtype", "float32", "--logits-processors", "vllm_msa.selection_log:SelectionLog"]
MSA = DEFAULT_CONFIG["msa_config"]
NUM_MSA_LAYERS = DEFAULT_CONFIG["num_hidden_layers"] - len(MSA["dense_layers"])
SOAK_SECONDS = 75
SOAK_MAX_RSS_GROWTH_MIB = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_server(tmp_path_factory.mktemp("server"), SERVER_FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _token_ids(n: int) -> list[int]:
    """A prompt of exactly n tokens (the OpenAI API takes token ids as a prompt)."""
    return [5 + (i * 7919) % 4000 for i in range(n)]


def _random_token_ids(n: int, seed: int) -> list[int]:
    """A prompt no other test sends, so it never hits the prefix cache."""
    rng = random.Random(seed)
    return [rng.randrange(5, DEFAULT_CONFIG["vocab_size"]) for _ in range(n)]


def _metrics(url: str) -> dict[str, float]:
    """The server's /metrics as {series: value}, series being `name{labels}` as exposed."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([^#\s][^ ]*) (\S+)$", text, re.MULTILINE)}


def _metric(url: str, name: str) -> float:
    """Sum of a metric's series (all label values)."""
    return sum(v for series, v in _metrics(url).items() if series.split("{")[0] == name)


def _wait_until_idle(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _metric(url, "vllm:num_requests_running") or _metric(url, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.5)


def test_log_names_the_msa_layers_and_backend(server, client):
    log = server.log_path.read_text()
    assert "'attention_backend': 'FLASH_MSA'" in log
    assert "MSA layers [1, 2, 3] on FLASH_MSA" in log
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_a_2k_token_prompt(client):
    started = time.monotonic()
    r = client.completions.create(
        model=MODEL, prompt=_token_ids(2048), max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    print(f"\n2K-token completion: {time.monotonic() - started:.2f} s, usage {r.usage}")
    assert r.usage.prompt_tokens == 2048 and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length" and r.choices[0].text


def test_streaming_completion_and_chat(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="def main():", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Say something about sparse attention."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = {  # name: (path, JSON body or raw bytes, status, part of the error message)
    "prompt longer than the context": (
        COMPLETIONS,
        {"prompt": _token_ids(9000), "max_tokens": 4},
        400,
        "maximum context length is 8192",
    ),
    "max_tokens beyond max-model-len": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 9000},
        400,
        "cannot be greater than max_model_len",
    ),
    "max_tokens 0": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    "empty prompt": (COMPLETIONS, {"prompt": "", "max_tokens": 4}, 400, "must be provided and non-empty"),
    "empty token list": (COMPLETIONS, {"prompt": [], "max_tokens": 4}, 400, "at least one prompt"),
    "empty conversation": (CHAT, {"messages": [], "max_tokens": 4}, 400, "empty conversation"),
    "token id out of vocabulary": (COMPLETIONS, {"prompt": [99999], "max_tokens": 4}, 400, "out of vocabulary"),
    "temperature -1": (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "temperature": -1}, 400, "temperature"),
    "top_p 1.5": (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    "n 0": (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "n": 0}, 400, "n must be at least 1"),
    "max_tokens not a number": (COMPLETIONS, {"prompt": "hi", "max_tokens": "four"}, 400, "valid integer"),
    "empty selection-log label": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "vllm_xargs": {"msa_log_selected_blocks": ""}},
        400,
        "msa_log_selected_blocks must be a non-empty string label",
    ),
    "malformed JSON": (COMPLETIONS, b'{"model": "demo-msa", "prompt": "hi"', 400, "JSON decode error"),
    "unknown model": (COMPLETIONS, {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, 404, "does not exist"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_a_clear_4xx(server, case):
    path, body, status, message = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL} | body).encode()
    r = requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text[:500]
    assert message in r.json()["error"]["message"]
    assert healthy(server.url)


def test_max_tokens_beyond_the_context_is_capped_at_the_context(server):
    """vLLM (since 0.32) serves such a request with max_tokens lowered to what the context leaves."""
    body = {"model": MODEL, "prompt": _token_ids(8000), "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    r = requests.post(server.url + COMPLETIONS, json=body, timeout=300)
    assert r.status_code == 200, r.text[:500]
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] == 8000 and answer["usage"]["completion_tokens"] == 8192 - 8000
    assert answer["choices"][0]["finish_reason"] == "length"
    assert healthy(server.url)


def test_server_keeps_serving_after_bad_requests(server, client):
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=4).usage.completion_tokens == 4
    _wait_until_idle(server.url)


def test_client_that_disconnects_gets_its_request_aborted(server, client):
    long_request = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True}
    generated_before = _metric(server.url, "vllm:generation_tokens_total")
    with requests.post(
        f"{server.url}{COMPLETIONS}",
        json=long_request | {"prompt": "x " * 100, "stream": True},
        stream=True,
        timeout=60,
    ) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data:"))
        assert all(json.loads(next(events)[5:])["choices"] for _ in range(3))
    try:  # non-streaming: the client gives up before the answer (it has no bytes to send until the end)
        whole_context = long_request | {"prompt": "y " * 100, "max_tokens": 8000}  # ~50 s of decoding here
        answer = requests.post(f"{server.url}{COMPLETIONS}", json=whole_context, timeout=2)
        pytest.fail(f"answered within the client's 2 s: {answer.status_code} {answer.text[:300]}")
    except requests.exceptions.ReadTimeout:
        pass
    _wait_until_idle(server.url, timeout_s=30)
    generated = _metric(server.url, "vllm:generation_tokens_total") - generated_before
    time.sleep(2)
    assert _metric(server.url, "vllm:generation_tokens_total") - generated_before == generated  # nothing runs on
    print(f"tokens generated by the two aborted requests: {generated:.0f}")
    assert generated < 2 * 3000  # both stopped early
    assert client.completions.create(model=MODEL, prompt="after the aborts", max_tokens=4).usage.completion_tokens == 4


def _expected_msa_metrics(num_positions: int, prompt_len: int) -> dict[str, float]:
    """The sparse-layer metrics of positions 0..num_positions-1 of one request, from their definition (the
    positions from prompt_len on are decode steps)."""
    bs, k = MSA["block_size"], MSA["topk_blocks"]
    per_selection = NUM_MSA_LAYERS * MSA["num_index_heads"]
    names = ["selections", "decode_selections", "selected_blocks", "context_tokens", "read_tokens"]
    expected = dict.fromkeys(names, 0.0)
    buckets = dict.fromkeys(["0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1.0", "+Inf"], 0.0)
    for p in range(num_positions):
        blocks = min(k, p // bs + 1)  # every visible block holds keys, so top-k fills up
        read = blocks * bs - (bs - 1 - p % bs)  # the own block is read up to the query
        expected["selections"] += per_selection
        expected["decode_selections"] += per_selection if p >= prompt_len else 0
        expected["selected_blocks"] += per_selection * blocks
        expected["context_tokens"] += per_selection * (p + 1)
        expected["read_tokens"] += per_selection * read
        for le in buckets:
            if le == "+Inf" or read / (p + 1) <= float(le):
                buckets[le] += per_selection
    series = {f"vllm:msa_{name}_total": v for name, v in expected.items()}
    series |= {f'vllm:msa_read_fraction_bucket{{le="{le}"': v for le, v in buckets.items()}
    return {f'{name}{"," if "{" in name else "{"}model_name="{MODEL}"}}': v for name, v in series.items()}


def test_sparse_layer_metrics_reach_the_api_server_metrics(server, client):
    """Counted in the worker process, scraped from the API server: exact for one request with known shape."""
    _wait_until_idle(server.url)
    before = _metrics(server.url)
    prompt_len, max_tokens = 2000, 16
    r = client.completions.create(
        model=MODEL,
        prompt=_random_token_ids(prompt_len, seed=11),
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == max_tokens
    after = _metrics(server.url)
    delta = {series: after[series] - before.get(series, 0.0) for series in after if series.startswith("vllm:msa_")}
    expected = _expected_msa_metrics(prompt_len + max_tokens - 1, prompt_len)  # the last token is never fed back
    assert {series: delta.get(series) for series in expected} == expected
    total = {series.split("{")[0]: v for series, v in delta.items()}
    fraction_read = total["vllm:msa_read_tokens_total"] / total["vllm:msa_context_tokens_total"]
    blocks_per_token = total["vllm:msa_selected_blocks_total"] / total["vllm:msa_selections_total"]
    selection_s, attention_s = total["vllm:msa_selection_seconds_total"], total["vllm:msa_attention_seconds_total"]
    print(
        f"\nMSA metrics for a {prompt_len}+{max_tokens} token request: {blocks_per_token:.2f} selected blocks "
        f"per token, {fraction_read:.3f} of the context read; selection time share "
        f"{selection_s / (selection_s + attention_s):.2f} over "
        f"{total['vllm:msa_timed_layer_calls_total']:.0f} timed calls"
    )
    assert 0.1 < fraction_read < 0.5 and 3.5 < blocks_per_token <= MSA["topk_blocks"]
    layer_calls = NUM_MSA_LAYERS * (max_tokens + 1)  # at least one prefill step, then a step per decoded token
    assert total["vllm:msa_timed_layer_calls_total"] >= layer_calls // SAMPLE_EVERY - 1
    assert selection_s > 0 and attention_s > 0


def _logged_selections(log_path: Path, label: str) -> dict[tuple[str, int], list[list[int]]]:
    pattern = rf"MSA selection {re.escape(label)} (\S+) position=(\d+) blocks=(\[.*\])"
    return {(m[1], int(m[2])): json.loads(m[3]) for m in re.finditer(pattern, log_path.read_text())}


def test_selection_log_shows_a_prefix_cache_hit_reusing_the_index_keys(server, client):
    """The second request hits the prefix cache for 11 blocks, so its selections read cached index keys."""
    prompt, max_tokens = _random_token_ids(1500, seed=12), 8
    hits_before = _metric(server.url, "vllm:prefix_cache_hits_total")
    texts = {}
    for label in ("probe-miss", "probe-hit"):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "vllm_xargs": {"msa_log_selected_blocks": label}},
        )
        texts[label] = r.choices[0].text
    assert _metric(server.url, "vllm:prefix_cache_hits_total") - hits_before == 1500 // 128 * 128
    assert texts["probe-hit"] == texts["probe-miss"]
    time.sleep(1)  # the worker's log lines pass through the engine process
    miss, hit = (_logged_selections(server.log_path, label) for label in ("probe-miss", "probe-hit"))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4) if i not in MSA["dense_layers"]]
    # Each step logs its last query token: the last prompt token, then every decoded token but the last.
    steps = {(layer, p) for layer in layers for p in range(1499, 1500 + max_tokens - 1)}
    assert steps <= miss.keys() and steps <= hit.keys()
    for layer, position in steps:
        own_block = position // 128
        for blocks in miss[layer, position]:
            assert len(blocks) == MSA["topk_blocks"] and own_block in blocks and max(blocks) == own_block
        assert hit[layer, position] == miss[layer, position], (layer, position)


def test_soak_with_long_prompts_cancellations_and_bad_requests(server, tmp_path):
    selections_before = _metric(server.url, "vllm:msa_selections_total")
    summary = run_load_test(
        server.url,
        profile="soak",
        users=4,
        run_time=SOAK_SECONDS,
        prompt_tokens=200,
        max_tokens=16,
        long_prompt_tokens=3000,
        report_dir=str(tmp_path),
        server_pid=server.pid,
        max_rss_growth_mib=SOAK_MAX_RSS_GROWTH_MIB,
    )
    rss = summary["rss"]
    print(
        f"\nsoak: {summary['total_requests']} requests, {summary['total_failures']} failures, "
        f"{summary['intended_bad_requests']} intended bad ones; server RSS {rss['start_mib']:.0f} MiB after "
        f"warm-up -> {rss['end_mib']:.0f} MiB at the end (peak {rss['peak_mib']:.0f})"
    )
    assert summary["ok"], summary["problems"]
    rows = {r["name"]: r for r in summary["rows"]}
    assert rows["/v1/completions [cancelled]"]["requests"] > 0 and summary["intended_bad_requests"] > 0
    _wait_until_idle(server.url, timeout_s=30)  # cancelled requests were aborted, nothing is left running
    assert _metric(server.url, "vllm:msa_selections_total") > selections_before
