"""Run the vllm-msa locust load test headless against a local vLLM server, and give its verdict.

This module owns the run: it refuses hosts that are not loopback, waits for GET /health
(`serve/local_server.py`), runs `locustfile.py` in a `python -m locust --headless` subprocess (streaming its
output, killed at a deadline), samples the server's memory if asked (`memory.py`), and reads locust's CSV
statistics into the summary and its table (`report.py`).

Profiles: `steady` (locustfile.VllmOpenAIUser) and `soak` (locustfile.SoakUser: short and long prompts,
cancellations, intended bad requests).

    python loadtests/run_load.py --host http://127.0.0.1:8000 --users 4 --run-time 30
    python loadtests/run_load.py --profile soak --run-time 90 --server-pid "$(pgrep -of 'vllm serve')"

Exit status: 0 if every request succeeded and at least one generation request succeeded (and, with a
server pid, its RSS grew by at most the bound); 1 if any request failed, locust reported errors, nothing
succeeded or memory grew too much; 2 for usage errors (a host that is not loopback, a server not healthy).

From Python (e.g. pytest):

    from loadtests.run_load import run
    summary = run("http://127.0.0.1:8011", users=2, run_time=20)
    assert summary["ok"], summary["problems"]
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a script
from loadtests.memory import RssSampler
from loadtests.report import format_summary, parse_locust_csv, summarize
from serve.local_server import NotHealthyError, wait_healthy

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
DEFAULT_HOST = "http://127.0.0.1:8000"
STOP_TIMEOUT_S = 30
PROFILES = {"steady": "VllmOpenAIUser", "soak": "SoakUser"}
DEFAULT_MAX_RSS_GROWTH_MIB = 256.0


class NonLoopbackHostError(ValueError):
    """The target host is not this machine."""


def check_loopback(host: str) -> str:
    """`host` without a trailing slash if it is an http(s) URL whose host is literally loopback (127.0.0.0/8,
    ::1, localhost); NonLoopbackHostError otherwise. Names are not resolved through DNS."""
    parsed = urllib.parse.urlsplit(host)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise NonLoopbackHostError(f"--host must be an http(s) URL such as {DEFAULT_HOST}, got {host!r}")
    name = parsed.hostname.rstrip(".").lower()
    ok = name == "localhost"
    if not ok:
        try:
            addr = ipaddress.ip_address(name)
        except ValueError:
            addr = None
        if addr is not None:
            mapped = getattr(addr, "ipv4_mapped", None)
            ok = addr.is_loopback or bool(mapped and mapped.is_loopback)
    if not ok:
        raise NonLoopbackHostError(
            f"refusing to load-test {parsed.hostname!r}: only loopback hosts (127.0.0.0/8, ::1, localhost) "
            "may be targeted from here"
        )
    try:
        parsed.port  # noqa: B018 - validates the port number
    except ValueError as e:
        raise NonLoopbackHostError(f"bad port in --host {host!r}: {e}") from None
    return host.rstrip("/")


def run(
    host: str = DEFAULT_HOST,
    users: int = 4,
    profile: str = "steady",
    run_time: int = 30,
    spawn_rate: float | None = None,
    prompt_tokens: int = 256,
    max_tokens: int = 32,
    long_prompt_tokens: int = 3000,
    model: str | None = None,
    report_dir: str | None = None,
    csv_prefix: str | None = None,
    health_timeout: float = 60.0,
    stream_output: bool = True,
    server_pid: int | None = None,
    max_rss_growth_mib: float = DEFAULT_MAX_RSS_GROWTH_MIB,
) -> dict[str, Any]:
    """Run the load test and return its summary (`report.summarize`, plus the run's settings and paths).

    server_pid: sample the RSS of that process and its children during the run; the run fails if it
    grows by more than max_rss_growth_mib from the end of the warm-up (a quarter of the run, at most
    15 s) to the end.
    Raises NonLoopbackHostError or serve.local_server.NotHealthyError before starting locust.
    `summary["ok"]` is the pass/fail verdict; `summary["problems"]` says why.
    """
    host = check_loopback(host)
    if users < 1 or run_time < 1:
        raise ValueError("users and run_time must be >= 1")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    spawn_rate = spawn_rate if spawn_rate is not None else float(users)
    print(f"[run_load] waiting up to {health_timeout:.0f} s for {host}/health", flush=True)
    waited = wait_healthy(host, health_timeout)
    print(f"[run_load] {host}/health -> 200 after {waited:.1f} s", flush=True)

    if csv_prefix is None:
        report_dir = report_dir or tempfile.mkdtemp(prefix="msa-load-")
        csv_prefix = str(Path(report_dir) / "locust")
    else:
        report_dir = report_dir or str(Path(csv_prefix).resolve().parent)
    Path(report_dir).mkdir(parents=True, exist_ok=True)
    Path(csv_prefix).resolve().parent.mkdir(parents=True, exist_ok=True)
    html = str(Path(report_dir) / "report.html")

    cmd = [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "-u", str(users),
        "-r", f"{spawn_rate:g}",
        "-t", f"{int(run_time)}s",
        "--host", host,
        "--csv", csv_prefix,
        "--html", html,
        "--exit-code-on-error", "1",
        "--stop-timeout", str(STOP_TIMEOUT_S),
        PROFILES[profile],
    ]  # fmt: skip
    env = dict(os.environ)
    env["MSA_PROMPT_TOKENS"] = str(prompt_tokens)
    env["MSA_MAX_TOKENS"] = str(max_tokens)
    env["MSA_LONG_PROMPT_TOKENS"] = str(long_prompt_tokens)
    if model:
        env["MSA_MODEL"] = model
    else:
        env.pop("MSA_MODEL", None)
    loop = "127.0.0.1,localhost,::1"
    for k in ("NO_PROXY", "no_proxy"):
        env[k] = ",".join(x for x in (env.get(k), loop) if x)
    env.setdefault("PYTHONUNBUFFERED", "1")

    print("[run_load] " + " ".join(cmd), flush=True)
    deadline = run_time + STOP_TIMEOUT_S + 90  # spawn + stop + report writing
    sampler = RssSampler(server_pid).start() if server_pid is not None else None
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE if stream_output else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # own process group, so a timeout can kill it all
    )
    timed_out = threading.Event()

    def _kill_on_deadline() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(deadline, _kill_on_deadline)
    watchdog.daemon = True
    watchdog.start()
    try:
        if stream_output:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)  # let locust stop users and write its reports
        proc.wait()
        raise
    finally:
        watchdog.cancel()
        if sampler is not None:
            sampler.stop()
    if timed_out.is_set():
        print(f"[run_load] locust exceeded {deadline}s and was killed", flush=True)
    wall = time.monotonic() - t0

    summary = summarize(parse_locust_csv(csv_prefix), rc)
    if not Path(f"{csv_prefix}_stats.csv").exists():
        summary["problems"].insert(0, "locust wrote no stats CSV")
        summary["ok"] = False
    if timed_out.is_set():
        summary["problems"].append("locust timed out")
        summary["ok"] = False
    if sampler is not None:
        summary["rss"] = sampler.summary(warmup_s=min(15.0, run_time / 4), max_growth_mib=max_rss_growth_mib)
        summary["problems"] += summary["rss"]["problems"]
        summary["ok"] = summary["ok"] and not summary["rss"]["problems"]
    summary.update(
        host=host, users=users, profile=profile, run_time=run_time, wall_s=round(wall, 1),
        csv_prefix=csv_prefix, html_report=html, report_dir=report_dir,
    )  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=DEFAULT_HOST, help=f"server base URL, loopback only (default {DEFAULT_HOST})")
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="steady",
        help="steady: the four request kinds; soak: plus long prompts, cancellations, bad requests",
    )
    p.add_argument("--users", type=int, default=4, help="concurrent simulated users (default 4)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--run-time", type=int, default=30, help="test duration in seconds (default 30)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="approximate prompt length in tokens (default 256)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument(
        "--long-prompt-tokens", type=int, default=3000, help="soak profile: long prompt length in tokens (default 3000)"
    )
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="sample this process tree's RSS during the run and bound its growth",
    )
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=DEFAULT_MAX_RSS_GROWTH_MIB,
        help=f"allowed RSS growth after warm-up, MiB (default {DEFAULT_MAX_RSS_GROWTH_MIB:.0f})",
    )
    p.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    p.add_argument("--report-dir", default=None, help="directory for CSV stats + report.html (default: a new temp dir)")
    p.add_argument("--csv-prefix", default=None, help="locust --csv prefix (default: REPORT_DIR/locust)")
    p.add_argument("--health-timeout", type=float, default=60.0, help="seconds to wait for GET /health (default 60)")
    a = p.parse_args(argv)
    try:
        summary = run(
            host=a.host, users=a.users, profile=a.profile, run_time=a.run_time, spawn_rate=a.spawn_rate,
            prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, long_prompt_tokens=a.long_prompt_tokens,
            model=a.model, server_pid=a.server_pid, max_rss_growth_mib=a.max_rss_growth_mib,
            report_dir=a.report_dir, csv_prefix=a.csv_prefix, health_timeout=a.health_timeout,
        )  # fmt: skip
    except (NonLoopbackHostError, NotHealthyError, ValueError) as e:
        print(f"run_load: error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(summary))
    print(f"[run_load] CSV: {summary['csv_prefix']}_stats.csv  HTML: {summary['html_report']}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
