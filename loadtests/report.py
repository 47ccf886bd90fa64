"""The load test's verdict and report: locust's CSV statistics parsed into a summary dict, and a table of it.

A run passes when no request failed, the user code raised nothing, at least one generation request
succeeded and locust exited cleanly; `summarize` lists what broke these in `problems`. Requests named
`[bad: ...]` (the soak's intended bad requests) are counted apart from the generations.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def _num(v: str | None) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a locust CSV file, or none if locust did not write it."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def parse_locust_csv(csv_prefix: str) -> dict[str, Any]:
    """Parse `{prefix}_stats.csv`, `_failures.csv` and `_exceptions.csv`."""
    rows: list[dict[str, Any]] = []
    aggregated: dict[str, Any] | None = None
    for r in _csv_rows(Path(f"{csv_prefix}_stats.csv")):
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
        for r in _csv_rows(Path(f"{csv_prefix}_failures.csv"))
    ]
    exceptions = [
        {"count": int(r.get("Count") or 0), "message": r.get("Message", ""), "traceback": r.get("Traceback", "")}
        for r in _csv_rows(Path(f"{csv_prefix}_exceptions.csv"))
    ]
    return {"rows": rows, "aggregated": aggregated, "failures": failures, "exceptions": exceptions}


def summarize(parsed: dict[str, Any], locust_rc: int | None) -> dict[str, Any]:
    """Totals, the verdict (`ok`) and its `problems`, with the parsed rows, failures and exceptions."""
    rows = parsed["rows"]
    http_rows = [r for r in rows if r["type"] != "METRIC"]
    bad_rows = [r for r in http_rows if "[bad:" in r["name"]]
    gen_rows = [r for r in http_rows if r["type"] == "POST" and r not in bad_rows]
    total_requests = sum(r["requests"] for r in http_rows)
    total_failures = sum(r["failures"] for r in rows)
    successful = sum(r["requests"] - r["failures"] for r in gen_rows)
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
        "metrics": {r["name"]: r for r in rows if r["type"] == "METRIC"},
        **parsed,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table per request name, the totals, the server's RSS, the failures and the verdict."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    name_w = max([len("name")] + [len(f"{r['type']} {r['name']}") for r in summary["rows"]])
    lines = [
        f"{'name':<{name_w}}  {'reqs':>6}  {'fails':>5}  {'p50 ms':>7}  {'p95 ms':>7}  {'avg ms':>7}  {'req/s':>6}",
        "-" * (name_w + 50),
    ]
    for r in sorted(summary["rows"], key=lambda r: (r["type"] == "METRIC", r["type"], r["name"])):
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
