"""Locust load profile for a vLLM OpenAI-compatible server (vllm-msa).

This module owns the *request mix and the per-request correctness checks* of
the load test; ``run_load.py`` owns running it (loopback-only host check,
health wait, headless locust subprocess, CSV summary, exit code).

What one simulated user does, in a closed loop with no think time
(``VllmOpenAIUser``, run_load's ``steady`` profile):

* POST /v1/completions       ``stream: true``   (weight 4)
* POST /v1/chat/completions  ``stream: true``   (weight 4)
* POST /v1/completions       non-streaming      (weight 1)
* POST /v1/chat/completions  non-streaming      (weight 1)

``SoakUser`` (the ``soak`` profile) sends the same four requests with a mix of
short (``MSA_PROMPT_TOKENS``) and long (``MSA_LONG_PROMPT_TOKENS``, one in
``MSA_LONG_EVERY`` requests) prompts, plus:

* POST /v1/completions [cancelled]  a stream the client closes after
  ``CANCEL_AFTER_CHUNKS`` content chunks (weight 1); it succeeds if those
  chunks arrived
* POST /v1/completions [bad: ...]   an intended bad request (prompt longer than
  the context, malformed JSON, top_p out of range; weight 1); it succeeds if the
  server answers 400 with an error message, fails otherwise

Every request uses ``temperature: 0`` and ``ignore_eos: true`` so the output
is exactly ``max_tokens`` long.  Streaming requests also ask for
``stream_options.include_usage`` so the final chunk reports token counts.

Locust statistics entries:

* ``POST <path> [stream]`` / ``POST <path>`` - one per HTTP request; the
  response time is the full end-to-end latency (until ``data: [DONE]`` for
  streams), not merely time-to-headers.
* ``METRIC ttft_ms`` - time to first token: from just before the request is
  sent until the first SSE chunk that carries non-empty generated text.
* ``METRIC itl_ms`` - inter-token latency: time between consecutive
  content-carrying SSE chunks (one sample per gap).
* ``GET /v1/models`` - only when the model name had to be discovered.

A streaming request is marked failed (``response.failure``) when: the HTTP
status is not 200; an SSE ``data:`` line holds an ``error`` object or is not
valid JSON; the stream ends without ``data: [DONE]``; no content chunk
arrives; or reading the stream raises (connection reset, timeout).  As an
extra guard, when the server reports ``usage.completion_tokens`` and it differs
from ``max_tokens`` the request fails too (disable with ``MSA_CHECK_LENGTH=0``).
A non-streaming request fails on non-200, an ``error`` object, no choices, or
empty output text.

Environment:

* ``MSA_MODEL``           model name; default: first id of GET /v1/models.
* ``MSA_PROMPT_TOKENS``   approximate prompt length in tokens (default 256).
* ``MSA_MAX_TOKENS``      tokens to generate per request (default 32).
* ``MSA_TEMPERATURE``     sampling temperature (default 0).
* ``MSA_REQUEST_TIMEOUT`` per-request timeout in seconds (default 300).
* ``MSA_CALIBRATE``       1 (default): use vLLM's POST /tokenize once to pick
                          the number of words that gives ~MSA_PROMPT_TOKENS;
                          0 or if /tokenize fails: assume ~1 token per word.
* ``MSA_CHECK_LENGTH``    1 (default): fail if usage.completion_tokens != max_tokens.
* ``MSA_LONG_PROMPT_TOKENS`` soak profile: long prompt length in tokens (default 3000).
* ``MSA_LONG_EVERY``      soak profile: one request in this many gets a long prompt (default 4).
* ``MSA_TOO_LONG_PROMPT_TOKENS`` soak profile: length of the intended too-long prompt; must exceed
                          the server's --max-model-len (default 100000).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import Any

import requests
import gevent
from locust import HttpUser, constant, events, task
from locust import stats as locust_stats

# Common short English words: in byte-level BPE vocabularies trained on English
# each " word" is usually a single token, so N words ~= N tokens.
WORDS = (
    "the of and to in is was for on are with as at be by this have from or had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know get through back much go good new write our me man too any day "
    "same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number"
).split()

CONTENT_CHUNK_FAIL = "stream ended with zero content chunks"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in ("0", "false", "no", "off")


PROMPT_TOKENS = max(1, _env_int("MSA_PROMPT_TOKENS", 256))
MAX_TOKENS = max(1, _env_int("MSA_MAX_TOKENS", 32))
TEMPERATURE = _env_float("MSA_TEMPERATURE", 0.0)
REQUEST_TIMEOUT = _env_float("MSA_REQUEST_TIMEOUT", 300.0)
CALIBRATE = _env_flag("MSA_CALIBRATE", True)
CHECK_LENGTH = _env_flag("MSA_CHECK_LENGTH", True)
LONG_PROMPT_TOKENS = max(1, _env_int("MSA_LONG_PROMPT_TOKENS", 3000))
LONG_EVERY = max(1, _env_int("MSA_LONG_EVERY", 4))
CANCEL_AFTER_CHUNKS = 2
TOO_LONG_PROMPT_IDS = max(1, _env_int("MSA_TOO_LONG_PROMPT_TOKENS", 100_000))  # token ids, past --max-model-len


class _Shared:
    """Per-process state resolved once (model name, words per prompt)."""

    lock = threading.Lock()  # gevent-patched by locust: a greenlet lock
    model: str | None = os.environ.get("MSA_MODEL", "").strip() or None
    n_words: int | None = None
    resolved = False


def make_prompt(n_words: int, rng: random.Random) -> str:
    """A random sequence of common words. A random order per request keeps
    vLLM's prefix cache from turning every prefill into a cache hit."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _calibrate_words(base_url: str, model: str) -> int | None:
    """Pick the word count whose tokenization is ~PROMPT_TOKENS via vLLM's
    /tokenize (not recorded in locust stats). Returns None if unavailable."""
    rng = random.Random(0)
    n = PROMPT_TOKENS
    sess = requests.Session()
    sess.trust_env = False  # never go through an HTTP proxy
    try:
        for _ in range(4):
            r = sess.post(
                base_url.rstrip("/") + "/tokenize",
                json={"model": model, "prompt": make_prompt(n, rng), "add_special_tokens": False},
                timeout=30,
            )
            if r.status_code != 200:
                return None
            count = int(r.json()["count"])
            if count <= 0:
                return None
            if abs(count - PROMPT_TOKENS) <= max(2, PROMPT_TOKENS // 50):
                break
            n = max(1, round(n * PROMPT_TOKENS / count))
        return n
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None
    finally:
        sess.close()


def _fire_metric(environment, name: str, value_ms: float) -> None:
    environment.events.request.fire(
        request_type="METRIC",
        name=name,
        response_time=value_ms,
        response_length=0,
        exception=None,
        context={},
    )


class VllmOpenAIUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.client.trust_env = False  # loopback target: ignore HTTP(S)_PROXY
        self.rng = random.Random()
        with _Shared.lock:
            if not _Shared.resolved:
                self._resolve_shared()

    # -- setup -------------------------------------------------------------

    def _resolve_shared(self) -> None:
        if _Shared.model is None:
            with self.client.get(
                "/v1/models", name="/v1/models", catch_response=True, timeout=30
            ) as resp:
                try:
                    ids = [m["id"] for m in resp.json()["data"]]
                except (ValueError, KeyError, TypeError):
                    ids = []
                if resp.status_code != 200 or not ids:
                    resp.failure(f"model discovery failed: HTTP {resp.status_code}")
                    return  # retried by the next user that starts
                _Shared.model = ids[0]
        n_words = _calibrate_words(self.host, _Shared.model) if CALIBRATE else None
        _Shared.n_words = n_words or PROMPT_TOKENS
        _Shared.resolved = True
        print(
            f"[locustfile] model={_Shared.model!r} prompt_tokens~{PROMPT_TOKENS} "
            f"({_Shared.n_words} words, calibrated={n_words is not None}) max_tokens={MAX_TOKENS}",
            flush=True,
        )

    def _body(self, chat: bool, stream: bool) -> dict[str, Any] | None:
        if not _Shared.resolved:
            with _Shared.lock:
                if not _Shared.resolved:
                    self._resolve_shared()
            if not _Shared.resolved:
                time.sleep(1.0)
                return None
        prompt = make_prompt(self._prompt_words(), self.rng)
        body: dict[str, Any] = {
            "model": _Shared.model,
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _prompt_words(self) -> int:
        return _Shared.n_words

    # -- tasks -------------------------------------------------------------

    @task(4)
    def completions_stream(self) -> None:
        self._streaming("/v1/completions", chat=False)

    @task(4)
    def chat_completions_stream(self) -> None:
        self._streaming("/v1/chat/completions", chat=True)

    @task(1)
    def completions(self) -> None:
        self._non_streaming("/v1/completions", chat=False)

    @task(1)
    def chat_completions(self) -> None:
        self._non_streaming("/v1/chat/completions", chat=True)

    # -- request implementations ------------------------------------------

    def _streaming(self, path: str, chat: bool) -> None:
        body = self._body(chat, stream=True)
        if body is None:
            return
        t_start = time.perf_counter()
        with self.client.post(
            path,
            json=body,
            name=f"{path} [stream]",
            stream=True,
            catch_response=True,
            timeout=REQUEST_TIMEOUT,
        ) as resp:
            # status_code 0 means a connection error (resp.error is set)
            if resp.status_code != 200:
                resp.failure(_http_error(resp))
                return
            try:
                error, n_bytes = self._consume_sse(resp, chat, t_start)
            finally:
                resp.close()  # an early return leaves unread body; don't pool that socket
            # report the end-to-end latency, not just time to response headers
            resp.request_meta["response_time"] = (time.perf_counter() - t_start) * 1000.0
            resp.request_meta["response_length"] = n_bytes
            if error:
                resp.failure(error)
            else:
                resp.success()

    def _consume_sse(self, resp, chat: bool, t_start: float) -> tuple[str | None, int]:
        """Read the SSE stream; fire ttft/itl metrics. Returns (error, bytes)."""
        n_bytes = 0
        n_content = 0
        done = False
        usage = None
        t_last = None
        try:
            # chunk_size=None: hand over data as soon as each HTTP chunk arrives
            for raw in resp.iter_lines(chunk_size=None):
                now = time.perf_counter()
                n_bytes += len(raw) + 1
                line = raw.strip()
                if not line or line.startswith(b":"):
                    continue  # event separator / SSE comment
                if not line.startswith(b"data:"):
                    continue  # event:, id:, retry: fields are not used by vLLM
                data = line[5:].strip()
                if done:
                    continue  # drain so the keep-alive connection can be reused
                if data == b"[DONE]":
                    done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    return f"invalid JSON in SSE line: {data[:120]!r}", n_bytes
                if not isinstance(chunk, dict):
                    return f"unexpected SSE payload: {data[:120]!r}", n_bytes
                if chunk.get("error") or chunk.get("object") == "error":
                    err = chunk.get("error", chunk)
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    return f"error in stream: {str(msg)[:200]}", n_bytes
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _has_content(chunk, chat):
                    n_content += 1
                    if t_last is None:
                        _fire_metric(self.environment, "ttft_ms", (now - t_start) * 1000.0)
                    else:
                        _fire_metric(self.environment, "itl_ms", (now - t_last) * 1000.0)
                    t_last = now
        except (requests.RequestException, OSError) as e:
            return f"stream read failed: {type(e).__name__}: {str(e)[:200]}", n_bytes
        if not done:
            return "stream ended without data: [DONE]", n_bytes
        if n_content == 0:
            return CONTENT_CHUNK_FAIL, n_bytes
        if CHECK_LENGTH and usage and usage.get("completion_tokens") not in (None, MAX_TOKENS):
            return (
                f"usage.completion_tokens={usage.get('completion_tokens')} != max_tokens={MAX_TOKENS}",
                n_bytes,
            )
        return None, n_bytes

    def _non_streaming(self, path: str, chat: bool) -> None:
        body = self._body(chat, stream=False)
        if body is None:
            return
        with self.client.post(
            path, json=body, name=path, catch_response=True, timeout=REQUEST_TIMEOUT
        ) as resp:
            if resp.status_code != 200:
                resp.failure(_http_error(resp))
                return
            try:
                payload = resp.json()
            except ValueError:
                resp.failure("response is not JSON")
                return
            if not isinstance(payload, dict) or payload.get("error"):
                resp.failure(f"error object in response: {str(payload)[:200]}")
                return
            choices = payload.get("choices") or []
            if not choices:
                resp.failure("response has no choices")
                return
            c0 = choices[0]
            text = (c0.get("message") or {}).get("content") if chat else c0.get("text")
            if not text:
                resp.failure("empty output text")
                return
            got = (payload.get("usage") or {}).get("completion_tokens")
            if CHECK_LENGTH and got not in (None, MAX_TOKENS):
                resp.failure(f"usage.completion_tokens={got} != max_tokens={MAX_TOKENS}")
                return
            resp.success()


class SoakUser(VllmOpenAIUser):
    """The steady mix with short and long prompts, client cancellations and intended bad requests."""

    def _prompt_words(self) -> int:
        if self.rng.randrange(LONG_EVERY):
            return _Shared.n_words
        return max(1, round(_Shared.n_words * LONG_PROMPT_TOKENS / PROMPT_TOKENS))

    @task(1)
    def cancelled_stream(self) -> None:
        body = self._body(chat=False, stream=True)
        if body is None:
            return
        body["max_tokens"] = 4 * MAX_TOKENS
        t_start = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, name="/v1/completions [cancelled]", stream=True,
            catch_response=True, timeout=REQUEST_TIMEOUT,
        ) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(_http_error(resp))
                return
            n_content = 0
            try:
                for raw in resp.iter_lines(chunk_size=None):
                    line = raw.strip()
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        if _has_content(json.loads(line[5:]), chat=False):
                            n_content += 1
                    if n_content >= CANCEL_AFTER_CHUNKS:
                        break
            except (requests.RequestException, OSError, ValueError) as e:
                resp.failure(f"stream read failed before cancelling: {type(e).__name__}: {str(e)[:200]}")
                return
            finally:
                resp.close()  # the cancellation: vLLM must abort the request
            resp.request_meta["response_time"] = (time.perf_counter() - t_start) * 1000.0
            if n_content < CANCEL_AFTER_CHUNKS:
                resp.failure(f"stream ended after {n_content} content chunks, before the client cancelled")
            else:
                resp.success()

    @task(1)
    def bad_request(self) -> None:
        if not _Shared.resolved:
            return
        kind = self.rng.choice(("prompt too long", "malformed JSON", "top_p out of range"))
        headers = {"Content-Type": "application/json"}
        base = {"model": _Shared.model, "max_tokens": MAX_TOKENS}
        if kind == "prompt too long":
            data = json.dumps(base | {"prompt": [5] * TOO_LONG_PROMPT_IDS})
        elif kind == "malformed JSON":
            data = json.dumps(base | {"prompt": "hi"})[:-1]
        else:
            data = json.dumps(base | {"prompt": "hi", "top_p": 2.0})
        with self.client.post(
            "/v1/completions", data=data, headers=headers, name=f"/v1/completions [bad: {kind}]",
            catch_response=True, timeout=REQUEST_TIMEOUT,
        ) as resp:  # fmt: skip
            try:
                message = (resp.json().get("error") or {}).get("message")
            except (ValueError, AttributeError):
                message = None
            if resp.status_code == 400 and message:
                resp.success()
            else:
                resp.failure(f"intended bad request ({kind}) got HTTP {resp.status_code}: {(resp.text or '')[:200]}")


def _has_content(chunk: dict, chat: bool) -> bool:
    """True if this SSE chunk carries generated text.

    Completions chunks: ``choices[i].text``.  Chat chunks: ``choices[i].delta``
    with ``content`` (vLLM's first chat chunk is ``{"role": "assistant",
    "content": ""}``, which is not counted) or ``reasoning_content`` /
    ``reasoning`` for reasoning parsers.  The usage-only chunk has
    ``choices: []``."""
    for choice in chunk.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                return True
        elif choice.get("text"):
            return True
    return False


def _http_error(resp) -> str:
    if resp.status_code == 0:
        err = getattr(resp, "error", None)
        return f"connection error: {type(err).__name__}: {str(err)[:200]}"
    detail = ""
    try:
        err = resp.json().get("error")
        detail = err.get("message", "") if isinstance(err, dict) else str(err or "")
    except (ValueError, AttributeError):
        detail = (resp.text or "")[:200]
    return f"HTTP {resp.status_code}: {detail[:200]}"



_ENV: list = []  # the locust Environment, captured at init


@events.init.add_listener
def _capture_env(environment, **_kwargs) -> None:
    _ENV[:] = [environment]


@events.quit.add_listener
def _flush_final_csv(**_kwargs) -> None:
    """locust's --csv writer snapshots the stats every CSV_STATS_INTERVAL_SEC
    and never writes a final snapshot, so requests that finish during the last
    second (while users stop) would be missing from *_stats.csv. The quit event
    fires before the CSV files are closed: yield long enough for one more
    snapshot so the CSV matches the final console table."""
    opts = getattr(_ENV[0], "parsed_options", None) if _ENV else None
    if opts is not None and getattr(opts, "csv_prefix", None):
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.5)
