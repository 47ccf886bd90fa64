"""Run the vllm-msa locust load test headless against a *local* vLLM server.

This module owns the run: it refuses non-loopback hosts, waits for
GET /health, runs ``locustfile.py`` in a ``python -m locust --headless``
subprocess (streaming its output), optionally samples the server's memory
(RSS of the server process and its children) during the run, parses locust's
CSV stats into a summary dict, prints a compact table and decides pass/fail.

Profiles: ``steady`` (locustfile.VllmOpenAIUser) and ``soak``
(locustfile.SoakUser: short and long prompts, cancellations, intended bad
requests).

Usage::

    python loadtests/run_load.py --host http://127.0.0.1:8000 --users 4 --run-time 30
    python loadtests/run_load.py --profile soak --run-time 90 --server-pid "$(pgrep -of 'vllm serve')"

Exit status: 0 if every request succeeded and at least one generation request
succeeded (and, with a server pid, its RSS grew by at most the stated bound);
1 if any request failed, locust reported errors, nothing succeeded or memory
grew too much; 2 for usage errors (non-loopback host, server not healthy).

In-process use (e.g. from pytest)::

    from loadtests.run_load import run
    summary = run("http://127.0.0.1:8011", users=2, run_time=20)
    assert summary["ok"], summary["problems"]
"""

from __future__ import annotations

import argparse
import csv
import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
LOCUSTFILE = os.path.join(HERE, "locustfile.py")
DEFAULT_HOST = "http://127.0.0.1:8000"
METRIC_NAMES = ("ttft_ms", "itl_ms")
STOP_TIMEOUT_S = 30
PROFILES = {"steady": "VllmOpenAIUser", "soak": "SoakUser"}
RSS_INTERVAL_S = 1.0
RSS_WINDOW_S = 10.0  # RSS start/end: medians over a window this long
DEFAULT_MAX_RSS_GROWTH_MIB = 256.0


class NonLoopbackHostError(ValueError):
    """The target host is not this machine."""


class ServerNotHealthyError(RuntimeError):
    """GET /health did not return 200 in time."""


def check_loopback(host: str) -> str:
    """Return ``host`` normalised (no trailing slash) if it is an http(s) URL
    whose host is literally loopback (127.0.0.0/8, ::1, localhost); raise
    NonLoopbackHostError otherwise. Names are not resolved via DNS."""
    parsed = urllib.parse.urlsplit(host)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise NonLoopbackHostError(
            f"--host must be an http(s) URL such as {DEFAULT_HOST}, got {host!r}"
        )
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
            f"refusing to load-test {parsed.hostname!r}: only loopback hosts "
            "(127.0.0.0/8, ::1, localhost) may be targeted from here"
        )
    try:
        parsed.port  # noqa: B018 - validates the port number
    except ValueError as e:
        raise NonLoopbackHostError(f"bad port in --host {host!r}: {e}") from None
    return host.rstrip("/")


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_for_health(host: str, timeout_s: float = 60.0, interval_s: float = 2.0) -> float:
    """Poll GET {host}/health until it returns 200; return seconds waited."""
    url = host.rstrip("/") + "/health"
    t0 = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            with _NO_PROXY_OPENER.open(url, timeout=5) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except (urllib.error.URLError, OSError) as e:
            status = f"{type(getattr(e, 'reason', e)).__name__}"
        waited = time.monotonic() - t0
        if status == 200:
            print(f"[run_load] {url} -> 200 after {waited:.1f}s", flush=True)
            return waited
        if waited >= timeout_s:
            raise ServerNotHealthyError(
                f"{url} did not return 200 within {timeout_s:.0f}s (last: {status})"
            )
        print(
            f"[run_load] waiting for {url} (attempt {attempt}, {waited:.0f}s/{timeout_s:.0f}s, last: {status})",
            flush=True,
        )
        time.sleep(min(interval_s, max(0.1, timeout_s - waited)))


class RssSampler:
    """Samples the RSS of a process and all its children (MiB) in a thread, once per second."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._t0 = time.monotonic()

    def _rss_mib(self) -> float:
        import psutil

        total = 0
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._t0, self._rss_mib()))
            self._stop.wait(RSS_INTERVAL_S)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, warmup_s: float, max_growth_mib: float) -> dict[str, Any]:
        """RSS after warm-up (median of the first window after warmup_s) vs at the end (last window)."""
        if not self.samples:
            return {"samples": 0, "problems": ["no RSS samples"]}
        end_t = self.samples[-1][0]
        start = [m for t, m in self.samples if warmup_s <= t < warmup_s + RSS_WINDOW_S]
        end = [m for t, m in self.samples if t > end_t - RSS_WINDOW_S]
        start_mib = _median(start or [self.samples[0][1]])
        end_mib = _median(end)
        growth = end_mib - start_mib
        problems = []
        if growth > max_growth_mib:
            problems.append(f"server RSS grew by {growth:.0f} MiB (bound {max_growth_mib:.0f} MiB)")
        return {
            "samples": len(self.samples),
            "first_mib": round(self.samples[0][1], 1),
            "start_mib": round(start_mib, 1),
            "end_mib": round(end_mib, 1),
            "peak_mib": round(max(m for _, m in self.samples), 1),
            "growth_mib": round(growth, 1),
            "max_growth_mib": max_growth_mib,
            "warmup_s": warmup_s,
            "problems": problems,
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _csv_rows(path: str) -> list[dict[str, str]]:
    """The rows of a locust CSV file, or none if locust did not write it."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def parse_locust_csv(csv_prefix: str) -> dict[str, Any]:
    """Parse ``{prefix}_stats.csv``, ``_failures.csv`` and ``_exceptions.csv``."""
    rows: list[dict[str, Any]] = []
    aggregated: dict[str, Any] | None = None
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        for r in csv.DictReader(f):
            row = {
                "type": r.get("Type", ""),
                "name": r.get("Name", ""),
                "requests": int(r.get("Request Count") or 0),
                "failures": int(r.get("Failure Count") or 0),
                "avg_ms": _num(r.get("Average Response Time")),
                "p50_ms": _num(r.get("50%")),
                "p95_ms": _num(r.get("95%")),
                "p99_ms": _num(r.get("99%")),
                "max_ms": _num(r.get("Max Response Time")),
                "rps": _num(r.get("Requests/s")) or 0.0,
            }
            if row["name"] == "Aggregated":
                aggregated = row
            else:
                rows.append(row)
    failures = [
        {
            "method": r.get("Method", ""),
            "name": r.get("Name", ""),
            "error": r.get("Error", ""),
            "occurrences": int(r.get("Occurrences") or 0),
        }
        for r in _csv_rows(f"{csv_prefix}_failures.csv")
    ]
    exceptions = [
        {"count": int(r.get("Count") or 0), "message": r.get("Message", ""), "traceback": r.get("Traceback", "")}
        for r in _csv_rows(f"{csv_prefix}_exceptions.csv")
    ]
    return {"rows": rows, "aggregated": aggregated, "failures": failures, "exceptions": exceptions}


def summarize(parsed: dict[str, Any], locust_rc: int | None) -> dict[str, Any]:
    rows = parsed["rows"]
    http_rows = [r for r in rows if r["type"] != "METRIC"]
    bad_rows = [r for r in http_rows if "[bad:" in r["name"]]
    gen_rows = [r for r in http_rows if r["type"] == "POST" and r not in bad_rows]
    total_requests = sum(r["requests"] for r in http_rows)
    total_failures = sum(r["failures"] for r in rows)
    successful = sum(r["requests"] - r["failures"] for r in gen_rows)
    metrics = {r["name"]: r for r in rows if r["type"] == "METRIC"}
    problems = []
    if total_failures:
        problems.append(f"{total_failures} request(s) failed")
    n_exc = sum(e["count"] for e in parsed["exceptions"])
    if n_exc:
        problems.append(f"{n_exc} exception(s) in locust user code")
    if successful == 0:
        problems.append("zero successful generation requests")
    if locust_rc not in (0, None) and not problems:
        problems.append(f"locust exited with status {locust_rc}")
    return {
        "ok": not problems,
        "problems": problems,
        "locust_returncode": locust_rc,
        "total_requests": total_requests,
        "total_failures": total_failures,
        "successful_requests": successful,
        "intended_bad_requests": sum(r["requests"] for r in bad_rows),
        "requests_per_s": sum(r["rps"] for r in http_rows),
        "generation_requests_per_s": sum(r["rps"] for r in gen_rows),
        "metrics": metrics,
        **parsed,
    }


def format_summary(summary: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    name_w = max([len("name")] + [len(f"{r['type']} {r['name']}") for r in summary["rows"]])
    lines = [
        f"{'name':<{name_w}}  {'reqs':>6}  {'fails':>5}  {'p50 ms':>7}  {'p95 ms':>7}  {'avg ms':>7}  {'req/s':>6}",
        "-" * (name_w + 50),
    ]
    order = sorted(summary["rows"], key=lambda r: (r["type"] == "METRIC", r["type"], r["name"]))
    for r in order:
        rps = "" if r["type"] == "METRIC" else f"{r['rps']:.2f}"
        lines.append(
            f"{r['type'] + ' ' + r['name']:<{name_w}}  {r['requests']:>6}  {r['failures']:>5}  "
            f"{ms(r['p50_ms']):>7}  {ms(r['p95_ms']):>7}  {ms(r['avg_ms']):>7}  {rps:>6}"
        )
    lines.append("-" * (name_w + 50))
    lines.append(
        f"HTTP requests: {summary['total_requests']}  failures: {summary['total_failures']}  "
        f"successful generations: {summary['successful_requests']}  "
        f"intended bad requests: {summary['intended_bad_requests']}  "
        f"total req/s: {summary['requests_per_s']:.2f}"
    )
    rss = summary.get("rss")
    if rss and rss.get("samples"):
        lines.append(
            f"server RSS (MiB): first {rss['first_mib']:.0f}, after {rss['warmup_s']:.0f} s warm-up "
            f"{rss['start_mib']:.0f}, end {rss['end_mib']:.0f}, peak {rss['peak_mib']:.0f}; "
            f"growth {rss['growth_mib']:.0f} (bound {rss['max_growth_mib']:.0f})"
        )
    for fl in sorted(summary["failures"], key=lambda f: -f["occurrences"])[:10]:
        lines.append(f"  FAIL x{fl['occurrences']} {fl['method']} {fl['name']}: {fl['error'][:200]}")
    for ex in summary["exceptions"][:5]:
        lines.append(f"  EXCEPTION x{ex['count']}: {ex['message'][:200]}")
    lines.append("RESULT: " + ("PASS" if summary["ok"] else "FAIL - " + "; ".join(summary["problems"])))
    return "\n".join(lines)


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
    """Run the load test and return the parsed summary (see ``summarize``).

    server_pid: sample the RSS of that process and its children during the run; the run fails if it
    grows by more than max_rss_growth_mib from the end of the warm-up (a quarter of the run, at most
    15 s) to the end.
    Raises NonLoopbackHostError / ServerNotHealthyError before starting locust.
    ``summary["ok"]`` is the pass/fail verdict; ``summary["problems"]`` says why.
    """
    host = check_loopback(host)
    if users < 1 or run_time < 1:
        raise ValueError("users and run_time must be >= 1")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    spawn_rate = spawn_rate if spawn_rate is not None else float(users)
    wait_for_health(host, health_timeout)

    if csv_prefix is None:
        report_dir = report_dir or tempfile.mkdtemp(prefix="msa-load-")
        csv_prefix = os.path.join(report_dir, "locust")
    else:
        report_dir = report_dir or os.path.dirname(os.path.abspath(csv_prefix))
    os.makedirs(report_dir, exist_ok=True)
    parent = os.path.dirname(os.path.abspath(csv_prefix))
    os.makedirs(parent, exist_ok=True)
    html = os.path.join(report_dir, "report.html")

    cmd = [
        sys.executable, "-m", "locust",
        "-f", LOCUSTFILE,
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
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

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

    if not os.path.exists(f"{csv_prefix}_stats.csv"):
        summary = summarize({"rows": [], "aggregated": None, "failures": [], "exceptions": []}, rc)
        summary["problems"].insert(0, "locust wrote no stats CSV")
        summary["ok"] = False
    else:
        summary = summarize(parse_locust_csv(csv_prefix), rc)
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
    p.add_argument("--profile", choices=sorted(PROFILES), default="steady",
                   help="steady: the four request kinds; soak: plus long prompts, cancellations, bad requests")
    p.add_argument("--users", type=int, default=4, help="concurrent simulated users (default 4)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--run-time", type=int, default=30, help="test duration in seconds (default 30)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="approximate prompt length in tokens (default 256)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--long-prompt-tokens", type=int, default=3000,
                   help="soak profile: long prompt length in tokens (default 3000)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="sample this process tree's RSS during the run and bound its growth")
    p.add_argument("--max-rss-growth-mib", type=float, default=DEFAULT_MAX_RSS_GROWTH_MIB,
                   help=f"allowed RSS growth after warm-up, MiB (default {DEFAULT_MAX_RSS_GROWTH_MIB:.0f})")
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
    except (NonLoopbackHostError, ServerNotHealthyError, ValueError) as e:
        print(f"run_load: error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(summary))
    print(f"[run_load] CSV: {summary['csv_prefix']}_stats.csv  HTML: {summary['html_report']}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
