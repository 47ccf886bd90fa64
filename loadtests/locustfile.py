"""The simulated users of the load test: the request mix, and what each request reports to locust.

`VllmOpenAIUser` (run_load's `steady` profile) loops with no think time over, by weight:
4 `POST /v1/completions` streamed, 4 `POST /v1/chat/completions` streamed, 1 of each not streamed.
`SoakUser` (the `soak` profile) sends the same with one request in `MSA_LONG_EVERY` on a long prompt, plus
`/v1/completions [cancelled]` (a stream the client closes after a few content chunks; vLLM must abort
it) and `/v1/completions [bad: KIND]` (an intended bad request that passes when the server answers 400
with an error message); each soak user sends one of each first, then draws by weight.

Locust statistics: one entry per request name, its time the full latency (until `data: [DONE]` for a
stream); `METRIC ttft_ms` (from just before sending to the first chunk with generated text) and `METRIC
itl_ms` (between consecutive content chunks) per stream; `GET /v1/models` when the model name had to be
found. What is sent: `workload.py`; how answers are judged: `responses.py`; running it: `run_load.py`.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from locust import stats as locust_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # locust imports this file by its path
from loadtests import workload
from loadtests.responses import answer_error, error_message, http_error, read_content_chunks, read_stream

EXPECTED_TOKENS = workload.MAX_TOKENS if workload.CHECK_LENGTH else None


class _Shared:
    """What this locust process resolves once for all its users: the model name and the words per prompt."""

    lock = threading.Lock()  # gevent-patched by locust: a greenlet lock
    model: str | None = workload.MODEL
    n_words: int | None = None
    resolved = False


def _fire_metric(environment, name: str, value_ms: float) -> None:
    environment.events.request.fire(
        request_type="METRIC", name=name, response_time=value_ms, response_length=0, exception=None, context={}
    )


class VllmOpenAIUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.client.trust_env = False  # loopback target: ignore HTTP(S)_PROXY
        self.rng = random.Random()
        with _Shared.lock:
            if not _Shared.resolved:
                self._resolve_shared()

    def _resolve_shared(self) -> None:
        if _Shared.model is None:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True, timeout=30) as resp:
                try:
                    ids = [m["id"] for m in resp.json()["data"]]
                except (ValueError, KeyError, TypeError):
                    ids = []
                if resp.status_code != 200 or not ids:
                    resp.failure(f"model discovery failed: HTTP {resp.status_code}")
                    return  # retried by the next user that starts
                _Shared.model = ids[0]
        n_words = workload.calibrate_words(self.host, _Shared.model) if workload.CALIBRATE else None
        _Shared.n_words = n_words or workload.PROMPT_TOKENS
        _Shared.resolved = True
        print(
            f"[locustfile] model={_Shared.model!r} prompt_tokens~{workload.PROMPT_TOKENS} "
            f"({_Shared.n_words} words, calibrated={n_words is not None}) max_tokens={workload.MAX_TOKENS}",
            flush=True,
        )

    def _body(self, chat: bool, stream: bool) -> dict | None:
        """The next request's body; None (after a pause) while the model name is still unknown."""
        if not _Shared.resolved:
            with _Shared.lock:
                if not _Shared.resolved:
                    self._resolve_shared()
            if not _Shared.resolved:
                time.sleep(1.0)
                return None
        prompt = workload.make_prompt(self._prompt_words(), self.rng)
        return workload.request_body(_Shared.model, prompt, chat, stream)

    def _prompt_words(self) -> int:
        return _Shared.n_words

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

    def _streaming(self, path: str, chat: bool) -> None:
        body = self._body(chat, stream=True)
        if body is None:
            return
        t_start = time.perf_counter()
        with self.client.post(
            path, json=body, name=f"{path} [stream]", stream=True, catch_response=True,
            timeout=workload.REQUEST_TIMEOUT_S,
        ) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(http_error(resp))
                return
            try:
                read = read_stream(resp, chat, EXPECTED_TOKENS)
            finally:
                resp.close()  # an early return leaves the body unread: do not pool that socket
            resp.request_meta["response_time"] = (time.perf_counter() - t_start) * 1000.0  # end to end
            resp.request_meta["response_length"] = read.n_bytes
            times = read.content_times
            if times:
                _fire_metric(self.environment, "ttft_ms", (times[0] - t_start) * 1000.0)
            for previous, now in pairwise(times):
                _fire_metric(self.environment, "itl_ms", (now - previous) * 1000.0)
            if read.error:
                resp.failure(read.error)
            else:
                resp.success()

    def _non_streaming(self, path: str, chat: bool) -> None:
        body = self._body(chat, stream=False)
        if body is None:
            return
        with self.client.post(
            path, json=body, name=path, catch_response=True, timeout=workload.REQUEST_TIMEOUT_S
        ) as resp:
            if resp.status_code != 200:
                resp.failure(http_error(resp))
                return
            try:
                error = answer_error(resp.json(), chat, EXPECTED_TOKENS)
            except ValueError:
                error = "response is not JSON"
            if error:
                resp.failure(error)
            else:
                resp.success()


class SoakUser(VllmOpenAIUser):
    """The steady mix with short and long prompts, client cancellations and intended bad requests.

    Each user opens with one cancelled stream and one bad request, so every soak run has both whatever
    the weighted draw picks afterwards.
    """

    def on_start(self) -> None:
        super().on_start()
        self.cancelled_stream()
        self.bad_request()

    def _prompt_words(self) -> int:
        if self.rng.randrange(workload.LONG_EVERY):
            return _Shared.n_words
        return workload.long_prompt_words(_Shared.n_words)

    @task(1)
    def cancelled_stream(self) -> None:
        body = self._body(chat=False, stream=True)
        if body is None:
            return
        body["max_tokens"] = 4 * workload.MAX_TOKENS
        t_start = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, name="/v1/completions [cancelled]", stream=True,
            catch_response=True, timeout=workload.REQUEST_TIMEOUT_S,
        ) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(http_error(resp))
                return
            try:
                n_content, error = read_content_chunks(resp, workload.CANCEL_AFTER_CHUNKS)
            finally:
                resp.close()  # the cancellation: vLLM must abort the request
            if error:
                resp.failure(error)
                return
            resp.request_meta["response_time"] = (time.perf_counter() - t_start) * 1000.0
            if n_content < workload.CANCEL_AFTER_CHUNKS:
                resp.failure(f"stream ended after {n_content} content chunks, before the client cancelled")
            else:
                resp.success()

    @task(1)
    def bad_request(self) -> None:
        if not _Shared.resolved:
            return
        kind = self.rng.choice(workload.BAD_REQUESTS)
        with self.client.post(
            "/v1/completions", data=workload.bad_request_data(kind, _Shared.model),
            headers={"Content-Type": "application/json"}, name=f"/v1/completions [bad: {kind}]",
            catch_response=True, timeout=workload.REQUEST_TIMEOUT_S,
        ) as resp:  # fmt: skip
            if resp.status_code == 400 and error_message(resp):
                resp.success()
            else:
                resp.failure(f"intended bad request ({kind}) got HTTP {resp.status_code}: {(resp.text or '')[:200]}")


_ENV: list = []  # the locust Environment, captured at init


@events.init.add_listener
def _capture_env(environment, **_kwargs) -> None:
    _ENV[:] = [environment]


@events.quit.add_listener
def _flush_final_csv(**_kwargs) -> None:
    """locust's --csv writer snapshots the stats every CSV_STATS_INTERVAL_SEC and never writes a final
    snapshot, so requests that finish while users stop would be missing from *_stats.csv. The quit event
    fires before the CSV files are closed: yield long enough for one more snapshot, so the CSV matches the
    final console table."""
    opts = getattr(_ENV[0], "parsed_options", None) if _ENV else None
    if opts is not None and getattr(opts, "csv_prefix", None):
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.5)
