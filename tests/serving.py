"""Starting the demo server for tests: a free loopback port, `bash serve/demo.sh` as the README runs it, started,
waited for and stopped by `serve/local_server.py`."""

import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve import local_server
from serve.local_server import NotHealthyError, wait_healthy

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
    """`bash serve/demo.sh --port P FLAGS` until /health answers; stopped with its processes on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "server.log"
    proc = local_server.start(["bash", "serve/demo.sh", "--port", str(port), *flags], log_path, env=env, cwd=ROOT)
    try:
        try:
            waited = wait_healthy(url, START_TIMEOUT_S, proc=proc)
        except NotHealthyError as e:
            pytest.fail(f"server did not come up: {e}:\n{log_path.read_text()[-4000:]}")
        print(f"\nserver up in {waited:.0f} s")
        yield Server(url, log_path, proc.pid)
    finally:
        local_server.stop(proc)
