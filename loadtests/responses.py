"""How the load test judges each answer: reading a server-sent-event stream, and checking a full answer.

A stream fails when an SSE `data:` line holds an `error` object or is not valid JSON (vLLM reports engine
errors inside a 200 stream), when it ends without `data: [DONE]`, when no chunk carries generated text,
when reading it raises, or (given the expected length) when `usage.completion_tokens` differs from it. A
non-streaming answer fails on an `error` object, no choices, empty text or a wrong `completion_tokens`.
Each check returns the failure's message, or None when the answer passes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import requests


@dataclass
class StreamRead:
    """One read stream: why it failed (None: it passed), its size, and when each content chunk arrived."""

    error: str | None = None
    n_bytes: int = 0
    content_times: list[float] = field(default_factory=list)  # time.perf_counter() per content chunk


def has_content(chunk: dict, chat: bool) -> bool:
    """True if this SSE chunk carries generated text.

    Completions chunks: `choices[i].text`. Chat chunks: `choices[i].delta` with `content` (vLLM's first chat
    chunk is `{"role": "assistant", "content": ""}`, which does not count) or `reasoning_content` /
    `reasoning` for reasoning parsers. The usage-only chunk has `choices: []`.
    """
    for choice in chunk.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                return True
        elif choice.get("text"):
            return True
    return False


def read_stream(resp: requests.Response, chat: bool, expected_tokens: int | None) -> StreamRead:
    """Read an SSE answer to its end; expected_tokens: the `usage.completion_tokens` it must report (None:
    not checked)."""
    read = StreamRead()
    done = False
    usage = None
    try:
        for raw in resp.iter_lines(chunk_size=None):  # each HTTP chunk as soon as it arrives
            now = time.perf_counter()
            read.n_bytes += len(raw) + 1
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # event separators, SSE comments; vLLM sends no event:, id: or retry: fields
            data = line[5:].strip()
            if done:
                continue  # drain, so the keep-alive connection can be reused
            if data == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                read.error = f"invalid JSON in SSE line: {data[:120]!r}"
                return read
            if not isinstance(chunk, dict):
                read.error = f"unexpected SSE payload: {data[:120]!r}"
                return read
            if chunk.get("error") or chunk.get("object") == "error":
                err = chunk.get("error", chunk)
                msg = err.get("message", err) if isinstance(err, dict) else err
                read.error = f"error in stream: {str(msg)[:200]}"
                return read
            if chunk.get("usage"):
                usage = chunk["usage"]
            if has_content(chunk, chat):
                read.content_times.append(now)
    except (requests.RequestException, OSError) as e:
        read.error = f"stream read failed: {type(e).__name__}: {str(e)[:200]}"
        return read
    if not done:
        read.error = "stream ended without data: [DONE]"
    elif not read.content_times:
        read.error = "stream ended with zero content chunks"
    elif expected_tokens is not None and usage and usage.get("completion_tokens") not in (None, expected_tokens):
        read.error = f"usage.completion_tokens={usage.get('completion_tokens')} != max_tokens={expected_tokens}"
    return read


def read_content_chunks(resp: requests.Response, n: int) -> tuple[int, str | None]:
    """Read a completions stream until n content chunks arrived (or it ended): (chunks read, error)."""
    n_content = 0
    try:
        for raw in resp.iter_lines(chunk_size=None):
            line = raw.strip()
            if (
                line.startswith(b"data:")
                and line[5:].strip() != b"[DONE]"
                and has_content(json.loads(line[5:]), chat=False)
            ):
                n_content += 1
            if n_content >= n:
                break
    except (requests.RequestException, OSError, ValueError) as e:
        return n_content, f"stream read failed before cancelling: {type(e).__name__}: {str(e)[:200]}"
    return n_content, None


def answer_error(payload: Any, chat: bool, expected_tokens: int | None) -> str | None:
    """Why a non-streaming answer's JSON fails, or None."""
    if not isinstance(payload, dict) or payload.get("error"):
        return f"error object in response: {str(payload)[:200]}"
    choices = payload.get("choices") or []
    if not choices:
        return "response has no choices"
    text = (choices[0].get("message") or {}).get("content") if chat else choices[0].get("text")
    if not text:
        return "empty output text"
    got = (payload.get("usage") or {}).get("completion_tokens")
    if expected_tokens is not None and got not in (None, expected_tokens):
        return f"usage.completion_tokens={got} != max_tokens={expected_tokens}"
    return None


def error_message(resp: requests.Response) -> str | None:
    """The `error.message` of a JSON error answer (vLLM's `{"error": {"message": ...}}`), or None."""
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("message") if isinstance(err, dict) else None


def http_error(resp: requests.Response) -> str:
    """A failed request in one line: the connection error, or the status and the server's message."""
    if resp.status_code == 0:  # locust's mark of a connection error (resp.error is set)
        err = getattr(resp, "error", None)
        return f"connection error: {type(err).__name__}: {str(err)[:200]}"
    return f"HTTP {resp.status_code}: {(error_message(resp) or resp.text or '')[:200]}"
