"""The serving smoke's requests (dev/gpu/serve_smoke.sh) to the server on 127.0.0.1:PORT serving MODEL as demo-msa.

    PORT=8000 MODEL=models/needle-msa PROMPTS="16 2000 8000" python3 dev/gpu/smoke_requests.py

A line per check, PASS or FAIL, exit status 1 if any failed:
  pass-key text  a 2048-token pass-key prompt (serve/eval_needle.py's prompts, greedy) as text on /v1/completions:
                 the completion starts with the key (MODEL must be a pass-key model, e.g. models/needle-msa)
  pass-key chat  the same prompt as one user message on /v1/chat/completions: answered (200, content); whether the
                 reply holds the key is printed, not checked (needle-msa was never trained on the chat format)
  bad request    max_tokens -3: a 400 whose error message names max_tokens; then the server still answers
  completions    token-id prompts of the PROMPTS lengths, greedy, 32 tokens each: usage counts them
  metrics        /metrics after them: FLASH_MSA's selections counted (decode and prompt tokens both), each in one
                 bucket of the read-fraction histogram, at least one block each
"""

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serve.eval_needle import cell_prompts, is_right  # noqa: E402
from training.needle_task import PassKeyTask, load_tokenizer  # noqa: E402
from vllm_msa.checkpoint import EOS  # noqa: E402

URL = f"http://127.0.0.1:{os.environ.get('PORT', '8000')}"
PASS_KEY_TOKENS = 2048  # 16 blocks: the model's top-4 reads a quarter of them


def post(path: str, body: dict) -> tuple[int, dict, float]:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.load(response), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), time.monotonic() - started


def main() -> int:
    results: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    model = Path(os.environ.get("MODEL", "models/needle-msa"))
    tokenizer = load_tokenizer(model)
    task = PassKeyTask(tokenizer, EOS)
    [prompt] = cell_prompts(task, PASS_KEY_TOKENS, 0.5, 1)
    text = tokenizer.decode(prompt.prompt_ids)

    status, reply, dt = post(
        "/v1/completions", {"model": "demo-msa", "prompt": text, "max_tokens": 8, "temperature": 0}
    )
    answer = reply["choices"][0]["text"] if status == 200 else reply
    check(
        "pass-key text",
        status == 200 and is_right("text", answer, prompt.key),
        f"key {prompt.key}, answer {answer!r}, {dt:.2f} s",
    )

    messages = [{"role": "user", "content": text}]
    status, reply, dt = post(
        "/v1/chat/completions", {"model": "demo-msa", "messages": messages, "max_tokens": 16, "temperature": 0}
    )
    content = reply["choices"][0]["message"]["content"] if status == 200 else None
    holds_key = content is not None and is_right("chat", content, prompt.key)
    check(
        "pass-key chat",
        status == 200 and bool(content),
        f"answered {content!r} (holds the key: {holds_key}), {dt:.2f} s",
    )

    status, reply, _ = post("/v1/completions", {"model": "demo-msa", "prompt": "Hello", "max_tokens": -3})
    message = str(reply.get("error", {}).get("message", reply))
    check("bad request", status == 400 and "max_tokens" in message, f"HTTP {status}: {message[:160]!r}")

    for n in map(int, os.environ.get("PROMPTS", "16 2000 8000").split()):
        ids = [5 + i % 4000 for i in range(n)]
        status, reply, dt = post(
            "/v1/completions", {"model": "demo-msa", "prompt": ids, "max_tokens": 32, "temperature": 0}
        )
        usage = reply.get("usage", {}) if status == 200 else reply
        ok = status == 200 and usage.get("prompt_tokens") == n and usage.get("completion_tokens", 0) > 0
        check(f"completion of {n} tokens", ok, f"HTTP {status}, {usage}, {dt:.2f} s")

    with urllib.request.urlopen(URL + "/metrics", timeout=60) as response:
        text = response.read().decode()
    counts = {
        name: sum(float(value) for value in re.findall(rf"^vllm:msa_{name}{{[^}}]*}} (\S+)$", text, re.M))
        for name in ("selections_total", "decode_selections_total", "selected_blocks_total", "read_fraction_count")
    }
    selections = counts["selections_total"]
    check(
        "metrics",
        0 < counts["decode_selections_total"] < selections == counts["read_fraction_count"]
        and counts["selected_blocks_total"] >= selections,
        str(counts),
    )

    failed = [name for name, ok, _ in results if not ok]
    print(
        f"smoke requests: {len(results) - len(failed)} of {len(results)} passed"
        + (f", failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
