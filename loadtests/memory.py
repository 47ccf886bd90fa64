"""The server's memory during a load test: the RSS of its process tree, sampled in a thread, and the bound
on its growth.

Once a second `RssSampler` adds up the RSS of the server process and all its children (API server, engine
core, workers). `summary` compares the median over the window just after the warm-up with the median over
the run's last window: growth past the bound is a problem of the run.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Any

INTERVAL_S = 1.0
WINDOW_S = 10.0  # RSS after warm-up and at the end: medians over a window this long


class RssSampler:
    """Samples the RSS (MiB) of a process and all its children in a thread, once per INTERVAL_S."""

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
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._t0, self._rss_mib()))
            self._stop.wait(INTERVAL_S)

    def start(self) -> RssSampler:
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
        start = [m for t, m in self.samples if warmup_s <= t < warmup_s + WINDOW_S]
        end = [m for t, m in self.samples if t > end_t - WINDOW_S]
        start_mib = statistics.median(start or [self.samples[0][1]])
        end_mib = statistics.median(end)
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
