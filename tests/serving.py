"""Starting the demo server for tests: a free loopback port, /health, and `bash serve/demo.sh` as the README runs it."""

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def demo_server(log_dir: Path, flags: list[str], env: dict[str, str] | None = None):
    """`bash serve/demo.sh --port P FLAGS` until /health answers; stopped (its process group) on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        ["bash", "serve/demo.sh", "--port", str(port), *flags],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ | (env or {}),
    )
    started = time.monotonic()
    try:
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"server did not come up (rc={proc.poll()}):\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        print(f"\nserver up in {time.monotonic() - started:.0f} s")
        yield Server(url, log_path, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
