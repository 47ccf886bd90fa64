"""The demo server started exactly as the README says (`bash serve/demo.sh`), queried over the OpenAI API.

One server for the module, on a free loopback port; it must answer good requests, turn bad ones
into clear 4xx errors and keep serving, and pass a short locust load test with zero failures.
"""

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from loadtests.run_load import run as run_load_test

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo-msa"
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        ["bash", "serve/demo.sh", "--port", str(port)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    started = time.monotonic()
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"server did not come up (rc={proc.poll()}):\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        print(f"\nserver up in {time.monotonic() - started:.0f} s")
        yield url, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _token_ids(n: int) -> list[int]:
    """A prompt of exactly n tokens (the OpenAI API takes token ids as a prompt)."""
    return [5 + (i * 7919) % 4000 for i in range(n)]


def test_log_names_the_msa_layers_and_backend(server, client):
    _, log_path = server
    log = log_path.read_text()
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
    chunks = list(client.completions.create(model=MODEL, prompt="def main():", max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Say something about sparse attention."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192"):
        client.completions.create(model=MODEL, prompt=_token_ids(9000), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert _healthy(server[0])
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=4).usage.completion_tokens == 4


def test_locust_load_test_has_no_failed_requests(server, tmp_path):
    summary = run_load_test(server[0], users=4, run_time=30, prompt_tokens=1000, max_tokens=16,
                            report_dir=str(tmp_path))
    assert summary["ok"], summary["problems"]
