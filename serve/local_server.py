"""Local vLLM servers: start one in its own process session with its log, wait until GET /health answers 200,
stop it with every process it started, also when this process is stopped by SIGTERM (`timeout`, `kill`); post JSON
requests to it.

The one Python helper for servers of the project: the tests' demo server (`tests/serving.py`) and the
end-to-end benchmark's servers (`serve/bench_e2e.py`, also serve/eval_needle.py's) start and stop through it,
the load test (`loadtests/run_load.py`) waits through it; the GPU tooling's shell scripts start and wait
through `dev/gpu/start_server.sh` and `wait_server.sh`. Requests go straight to the server, never through an
HTTP proxy named in the environment: every server here listens on loopback. Standard library only, so the load
test runs it without vLLM installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback servers: never through a proxy


class NotHealthyError(RuntimeError):
    """The server exited, or /health did not answer 200 in time; the message says which."""


def health_status(url: str, timeout_s: float = 5.0) -> int | str:
    """GET {url}/health once: the HTTP status, or the name of the error that stopped the request."""
    try:
        with DIRECT.open(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:  # URLError included: connection refused, reset, timeout
        return type(getattr(e, "reason", e)).__name__


def healthy(url: str) -> bool:
    return health_status(url) == 200


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    """POST body as JSON to url (e.g. {server}/v1/completions) and return the JSON answer; urllib's errors (an
    HTTPError for a non-2xx answer) are OSErrors."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with DIRECT.open(request, timeout=timeout_s) as response:
        return json.load(response)


def wait_healthy(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    started: float | None = None,
    interval_s: float = 2.0,
) -> float:
    """Poll GET {url}/health until it answers 200; return the seconds since `started`.

    `started` is a `time.monotonic()` reading (default: now), so servers started together can be waited
    for one after another, each against its own start. Raises NotHealthyError when `proc`, the server's
    process, exits first, or when timeout_s have passed since `started`.
    """
    started = time.monotonic() if started is None else started
    while (status := health_status(url)) != 200:
        waited = time.monotonic() - started
        if proc is not None and proc.poll() is not None:
            raise NotHealthyError(f"server exited with {proc.returncode} before it was healthy")
        if waited >= timeout_s:
            raise NotHealthyError(f"server not healthy after {timeout_s:.0f} s (last answer: {status})")
        time.sleep(min(interval_s, timeout_s - waited))
    return time.monotonic() - started


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in this process, as Ctrl-C raises KeyboardInterrupt, so that the caller's
    `finally: stop(proc)` runs: a server in its own session outlives a caller killed outright, keeping its port
    and device memory from whatever runs next. Only from the main thread, and only over the default action."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def start(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Start a server command (`vllm serve ...`, `bash serve/demo.sh ...`) in its own process session, its output
    in log_path; stop() stops it with its engine and worker processes (exit_on_sigterm: also after a SIGTERM)."""
    exit_on_sigterm()
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=None if env is None else os.environ | env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Terminate the API server (it stops its engine processes), then kill what is left of its session."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
