"""What the simulated users send: the load's settings, the prompts and the request bodies.

The settings come from the environment, which `run_load.py` fills from its flags (or set them yourself
to run `locust -f loadtests/locustfile.py` directly); see `loadtests/README.md`. Prompts are random
sequences of common English words in a new order per request, so vLLM's prefix cache does not turn
every prefill into a cache hit; `calibrate_words` asks the server's `POST /tokenize` once how many words
give about `PROMPT_TOKENS` tokens. Every request uses temperature 0 and `ignore_eos`, so each answer is
exactly `max_tokens` long.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import requests

# Common short English words: in byte-level BPE vocabularies trained on English each " word" is usually
# a single token, so N words ~= N tokens.
WORDS = (  # noqa: SIM905  (a word list reads better as text)
    "the of and to in is was for on are with as at be by this have from or had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know get through back much go good new write our me man too any day "
    "same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number"
).split()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in ("0", "false", "no", "off")


MODEL = os.environ.get("MSA_MODEL", "").strip() or None  # None: the first id of GET /v1/models
PROMPT_TOKENS = max(1, _env_int("MSA_PROMPT_TOKENS", 256))
MAX_TOKENS = max(1, _env_int("MSA_MAX_TOKENS", 32))
TEMPERATURE = _env_float("MSA_TEMPERATURE", 0.0)
REQUEST_TIMEOUT_S = _env_float("MSA_REQUEST_TIMEOUT", 300.0)
CALIBRATE = _env_flag("MSA_CALIBRATE", True)
CHECK_LENGTH = _env_flag("MSA_CHECK_LENGTH", True)
LONG_PROMPT_TOKENS = max(1, _env_int("MSA_LONG_PROMPT_TOKENS", 3000))  # soak
LONG_EVERY = max(1, _env_int("MSA_LONG_EVERY", 4))  # soak: one request in this many gets a long prompt
TOO_LONG_PROMPT_IDS = max(1, _env_int("MSA_TOO_LONG_PROMPT_TOKENS", 100_000))  # soak: past --max-model-len
CANCEL_AFTER_CHUNKS = 2  # soak: content chunks a cancelled stream reads before the client closes it
BAD_REQUESTS = ("prompt too long", "malformed JSON", "top_p out of range")  # soak


def make_prompt(n_words: int, rng: random.Random) -> str:
    """A random sequence of common words, in a new order per request."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def long_prompt_words(n_words: int) -> int:
    """The word count of a long prompt, given the count that makes PROMPT_TOKENS tokens."""
    return max(1, round(n_words * LONG_PROMPT_TOKENS / PROMPT_TOKENS))


def calibrate_words(base_url: str, model: str) -> int | None:
    """The word count whose tokenization is about PROMPT_TOKENS, through vLLM's POST /tokenize (not in the
    locust statistics); None where /tokenize does not answer."""
    rng = random.Random(0)
    n = PROMPT_TOKENS
    session = requests.Session()
    session.trust_env = False  # never through an HTTP proxy
    try:
        for _ in range(4):
            r = session.post(
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
        session.close()


def request_body(model: str, prompt: str, chat: bool, stream: bool) -> dict[str, Any]:
    """A completion (chat: a chat completion) of MAX_TOKENS tokens; a stream reports its usage at the end."""
    body: dict[str, Any] = {
        "model": model,
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


def bad_request_data(kind: str, model: str) -> str:
    """The JSON text of an intended bad request of one of the BAD_REQUESTS kinds."""
    base = {"model": model, "max_tokens": MAX_TOKENS}
    if kind == "prompt too long":
        return json.dumps(base | {"prompt": [5] * TOO_LONG_PROMPT_IDS})
    if kind == "malformed JSON":
        return json.dumps(base | {"prompt": "hi"})[:-1]
    if kind == "top_p out of range":
        return json.dumps(base | {"prompt": "hi", "top_p": 2.0})
    raise ValueError(f"unknown bad request kind {kind!r}")
