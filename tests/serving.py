"""Starting the demo server for tests: a free loopback port, `bash serve/demo.sh` as the README runs it, and
the wait for its /health (`serve/health.py`)."""

import os
import signal
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve.health import NotHealthyError, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600


@dataclass
class Server:
    url: str
    log_path: Path
    pid: int  # the API server (demo.sh execs `vllm serve`); engine and workers are its children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def demo_server(log_dir: Path, flags: list[str], env: dict[str, str] | None = None):
    """`bash serve/demo.sh --port P FLAGS` until /health answers; stopped (its process group) on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", "serve/demo.sh", "--port", str(port), *flags],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | (env or {}),
        )
        try:
            try:
                waited = wait_healthy(url, START_TIMEOUT_S, proc=proc)
            except NotHealthyError as e:
                pytest.fail(f"server did not come up: {e}:\n{log_path.read_text()[-4000:]}")
            print(f"\nserver up in {waited:.0f} s")
            yield Server(url, log_path, proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
