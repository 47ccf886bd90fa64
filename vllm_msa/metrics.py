"""FLASH_MSA's Prometheus metrics: what the sparse layers select, counted in the worker, served on
vLLM's /metrics by the API server.

vLLM runs the model in a worker process; /metrics is served by the API server process. Transport:
the plugin, loaded first in the API server (the process tree's root), creates a directory, names it
in FLASH_MSA_METRICS_DIR for the engine and worker processes it spawns, and registers MSACollector
on prometheus_client's default registry (the one vLLM's /metrics serves with one API server). Each
worker keeps running totals on its device and copies them once per step into its own small
memory-mapped file there; the collector sums the files of live workers when /metrics is scraped.

    vllm:msa_selections_total          top-k selections: one per query token, MSA layer and index head
    vllm:msa_decode_selections_total   those of tokens in a step's decode part (the decode kernels): decode
                                       requests and speculative verification
    vllm:msa_selected_blocks_total     KV blocks those selections picked
    vllm:msa_context_tokens_total      visible context tokens (position + 1) of those selections
    vllm:msa_read_tokens_total         context tokens those selections let attention read
    vllm:msa_read_fraction             histogram, per selection: read tokens / context tokens
    vllm:msa_kv_saturated_total        K/V values of prompt tokens past an FP8 K/V cache's range (stored
                                       saturated at +-448 x scale; the worker warns once when it first rises)
    vllm:msa_kv_device_tier_hits_total    with the host tier (host_tier.py): K/V pages decode steps read from
    vllm:msa_kv_device_tier_misses_total  the device tier, and those copied in from host memory, per layer
    vllm:msa_kv_host_to_device_bytes_total  bytes of those copies
    vllm:msa_timed_layer_calls_total   MSA layer calls timed (one in SAMPLE_EVERY, eager calls only)
    vllm:msa_selection_seconds_total   their index scores + top-k time
    vllm:msa_attention_seconds_total   their sparse attention time

Mean selected blocks per token = selected_blocks / selections; share of query tokens on the decode
kernels = decode_selections / selections; fraction of context read = read_tokens / context_tokens;
selection time share = selection_seconds / (selection_seconds + attention_seconds). Timing uses CUDA
events read back once the GPU has passed them (no sync; calls replayed from a CUDA graph are not timed),
or the host clock on CPU.

Which layer call records and publishes, on which rank, is decided in observer.py (StepObserver).
Cost: per step, on the last MSA layer's [T, Hi, K] selection, the selection totals counted for every MSA layer of
the process (each selects min(K, visible blocks) blocks per token and index head, whatever the scores), on its
device and without a host sync, so a CUDA graph records them (its padding tokens count nothing): one kernel launch
on Hopper (msa_kernels/cute/selection_stats.py), elsewhere ~35 small PyTorch ops (msa_kernels/selection_stats.py;
on a 2-core CPU 0.23 ms for an 8-token decode step, 0.5 ms for a 2048-token
chunk). With an FP8 K/V cache, each MSA layer call of a step with prompt tokens adds five ops counting its
saturated K/V values (never in a decode-only step): 0.28 ms for a 2048-token chunk of the demo's K/V on that
CPU (results/README.md, "Cost of the sparse-layer metrics"). Then, once per step, the 18 device totals and 3 timing
totals (float64) are copied into the file: a memcpy on CPU, on CUDA an asynchronous copy into pinned memory
that reaches the file one step later, once its event has completed. Steps that replay a full CUDA graph
run no Python: their totals are published from the next step's metadata build.
"""

import atexit
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from vllm.logger import init_logger

from msa_kernels import ops
from msa_kernels.fp8_index_keys import E4M3_MAX
from msa_kernels.selection_stats import (
    READ_FRACTION_BUCKETS,
    READ_FRACTION_FIELDS,
    SELECTION_COUNTERS,
    SELECTION_FIELDS,
)

logger = init_logger("vllm.msa")  # under "vllm" so vLLM's log handlers print it

DIR_ENV = "FLASH_MSA_METRICS_DIR"  # not VLLM_*: vLLM (since 0.32) warns at start-up about VLLM_* names it does not know
COUNTERS = {
    "selections": "Top-k block selections by FLASH_MSA layers (one per query token, MSA layer and index head).",
    "decode_selections": "Selections of query tokens that ran the decode kernels (decode requests and speculative "
    "verification); divided by vllm:msa_selections_total: their share of the query tokens.",
    "selected_blocks": "KV blocks selected; divided by vllm:msa_selections_total: mean selected blocks per token.",
    "context_tokens": "Visible context tokens of the selections (position + 1, summed).",
    "read_tokens": "Context tokens the selections let attention read; divided by "
    "vllm:msa_context_tokens_total: fraction of context read.",
    "kv_saturated": "K/V values of prompt tokens that MSA layers wrote past an FP8 K/V cache's range (|value| > 448 x "
    "the layer's scale), stored as +-448 x scale (steps of decodes only are not counted).",
    "kv_device_tier_hits": "K/V pages decode steps of MSA layers read from their host tier's device pages "
    "(--additional-config flash_msa_kv_device_pages), per layer; divided by it plus "
    "vllm:msa_kv_device_tier_misses_total: the hit rate.",
    "kv_device_tier_misses": "K/V pages decode steps of MSA layers copied into their device tier from host memory.",
    "kv_host_to_device_bytes": "Bytes of those copies (misses x page bytes).",
}
TIMING = {
    "timed_layer_calls": "FLASH_MSA layer calls timed (one in SAMPLE_EVERY eager calls).",
    "selection_seconds": "Index scores + top-k time of the timed calls; divided by it plus "
    "vllm:msa_attention_seconds_total: the selection time share.",
    "attention_seconds": "Sparse attention time of the timed calls.",
}
SAMPLE_EVERY = 16
# File layout (float64): the device totals, first the selections' (msa_kernels.selection_stats: its counters, the
# read-fraction sum, one count per bucket plus +Inf, which one launch adds), then the other counters; then the timing
# (host totals).
assert tuple(COUNTERS)[: len(SELECTION_COUNTERS)] == SELECTION_COUNTERS
DEVICE_FIELDS = (*SELECTION_FIELDS, *tuple(COUNTERS)[len(SELECTION_COUNTERS) :])
FIELDS = (*DEVICE_FIELDS, *TIMING)
FIELDS_INDEX = {name: i for i, name in enumerate(FIELDS)}
HEADER_BYTES = 4096  # JSON header, space padded; the values follow
FILE_SUFFIX = ".msa-metrics"


class StageClock:
    """Marks in one MSA layer call: start, selection done, attention done (CUDA events or host clock)."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> tuple[float, float] | None:
        """(selection, attention) seconds once the device has passed the last mark, else None."""
        if len(self.marks) < 3 or (self.on_cuda and not self.marks[2].query()):
            return None
        start, selected, attended = self.marks
        if self.on_cuda:
            return start.elapsed_time(selected) / 1e3, selected.elapsed_time(attended) / 1e3
        return selected - start, attended - selected


class StepStats:
    """One worker process's running totals (selections on the model's device, timing on the host) and their file."""

    def __init__(self, device: torch.device, model_name: str) -> None:
        self.device = device
        self.totals = torch.zeros(len(DEVICE_FIELDS), dtype=torch.float64, device=device)
        self.add_selection_stats = ops.selection_stats_adder(device)
        self.file_values = _create_file(model_name)
        on_cpu = device.type == "cpu"
        self.staging = None if on_cpu else torch.empty(len(DEVICE_FIELDS), dtype=torch.float64, pin_memory=True)
        self.copied: torch.Event | None = None
        self.calls = 0
        self.clocks: list[StageClock] = []  # timed calls not yet read back
        self.timing = np.zeros(len(TIMING))
        self.warned_saturated = False

    def clock(self) -> StageClock | None:
        """A StageClock for this layer call if it is sampled (one in SAMPLE_EVERY, never in graph capture)."""
        self.calls += 1
        if self.calls % SAMPLE_EVERY or (self.staging is not None and torch.cuda.is_current_stream_capturing()):
            return None
        self.clocks.append(StageClock(self.device))
        return self.clocks[-1]

    def record(
        self, selected: torch.Tensor, positions: torch.Tensor, block_size: int, decode_tokens: int, layers: int = 1
    ) -> None:
        """selected [T, Hi, K] logical block ids (-1 = none), positions [>= T] of the query tokens, the first
        decode_tokens of them the step's decode part; counted for `layers` MSA layers that selected as many
        blocks (msa_kernels.selection_stats)."""
        selection_totals = self.totals[: len(SELECTION_FIELDS)]
        self.add_selection_stats(selection_totals, selected, positions, block_size, decode_tokens, layers)

    def count_saturated(self, key: torch.Tensor, value: torch.Tensor, kv_scales: tuple[float, float]) -> None:
        """Add the values of key/value that an FP8 K/V cache with scales (k_scale, v_scale) stores saturated (at
        +-E4M3_MAX x scale, as reference.write_paged and vLLM's cache op write them)."""
        k_scale, v_scale = kv_scales
        saturated = (key.abs() > E4M3_MAX * k_scale).sum() + (value.abs() > E4M3_MAX * v_scale).sum()
        self.totals[FIELDS_INDEX["kv_saturated"]] += saturated

    def count_host_tier(self, hits: torch.Tensor, misses: torch.Tensor, page_bytes: int) -> None:
        """Add a layer call's device-tier hits and misses ([] int32 on the device) and the bytes its misses copied."""
        first = FIELDS_INDEX["kv_device_tier_hits"]
        counts = torch.stack([hits, misses]).double()
        self.totals[first : first + 2] += counts
        self.totals[first + 2] += counts[1] * page_bytes

    def publish(self) -> None:
        if self.file_values is None or (self.staging is not None and torch.cuda.is_current_stream_capturing()):
            return
        self._read_clocks()
        self.file_values[len(DEVICE_FIELDS) :] = torch.from_numpy(self.timing)
        if self.staging is None:
            self.file_values[: len(DEVICE_FIELDS)].copy_(self.totals)
            self._warn_saturated()
            return
        if self.copied is not None and self.copied.query():
            self.file_values[: len(DEVICE_FIELDS)].copy_(self.staging)
            self.copied = None
            self._warn_saturated()
        if self.copied is None:
            self.staging.copy_(self.totals, non_blocking=True)
            self.copied = torch.Event(self.totals.device)
            self.copied.record()

    def _warn_saturated(self) -> None:
        """Once per process, when the file first shows saturated K/V values."""
        assert self.file_values is not None  # publish writes the file first
        saturated = int(self.file_values[FIELDS_INDEX["kv_saturated"]])
        if saturated and not self.warned_saturated:
            self.warned_saturated = True
            logger.warning(
                "FLASH_MSA: %d K/V values of prompt tokens were past the FP8 K/V cache's range (|value| > 448 x the "
                "layer's k_scale or v_scale) and were stored saturated, which changes attention: this checkpoint "
                "needs larger K/V scales than it carries (1.0 where it has none); serve it without --kv-cache-dtype "
                "fp8 or with calibrated scales. vllm:msa_kv_saturated_total keeps counting",
                saturated,
            )

    def _read_clocks(self) -> None:
        pending = []
        for clock in self.clocks:
            seconds = clock.seconds()
            if seconds is None:
                pending.append(clock)
            else:
                self.timing += (1.0, *seconds)
        self.clocks = pending


def _create_file(model_name: str) -> torch.Tensor | None:
    """This process's metrics file, zeroed, as a float64 tensor over its mmap; None without a directory."""
    directory = os.environ.get(DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return None
    path = Path(directory) / f"{os.getpid()}{FILE_SUFFIX}"
    header = json.dumps({"fields": FIELDS, "model_name": model_name}).encode().ljust(HEADER_BYTES)
    assert len(header) == HEADER_BYTES, "metrics header too long"
    staged = path.with_suffix(".tmp")
    staged.write_bytes(header + bytes(8 * len(FIELDS)))
    staged.rename(path)  # readers never see a partial file
    values = np.memmap(path, dtype=np.float64, mode="r+", offset=HEADER_BYTES, shape=(len(FIELDS),))
    return torch.from_numpy(values)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def read_totals(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Totals per model name over the live workers' files; dead workers' files are removed."""
    totals: dict[str, np.ndarray] = {}
    for path in Path(directory).glob(f"*{FILE_SUFFIX}"):
        if not _pid_alive(int(path.name.removesuffix(FILE_SUFFIX))):
            path.unlink(missing_ok=True)
            continue
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        header = json.loads(raw[:HEADER_BYTES])
        if tuple(header["fields"]) != FIELDS:
            continue  # written by another vllm-msa version
        values = np.frombuffer(raw, dtype=np.float64, offset=HEADER_BYTES, count=len(FIELDS))
        name = header["model_name"]
        totals[name] = totals.get(name, 0) + values
    return totals


class MSACollector:
    """Prometheus collector of the workers' totals (prometheus_client calls collect() per scrape)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        counters = {
            name: CounterMetricFamily(f"vllm:msa_{name}", doc, labels=["model_name"])
            for name, doc in (COUNTERS | TIMING).items()
        }
        fraction = HistogramMetricFamily(
            "vllm:msa_read_fraction",
            "Per FLASH_MSA selection: context tokens read / visible context tokens.",
            labels=["model_name"],
        )
        for model_name, values in sorted(read_totals(self.directory).items()):
            for name, family in counters.items():
                family.add_metric([model_name], float(values[FIELDS_INDEX[name]]))
            fraction_sum = FIELDS_INDEX[READ_FRACTION_FIELDS[0]]
            cumulative = np.cumsum(values[fraction_sum + 1 : fraction_sum + len(READ_FRACTION_FIELDS)])
            bounds = [str(b) for b in READ_FRACTION_BUCKETS] + ["+Inf"]
            fraction.add_metric(
                [model_name], list(zip(bounds, cumulative.tolist())), sum_value=float(values[fraction_sum])
            )
        yield from counters.values()
        yield fraction


_collector_directory: str | None = None


def install() -> None:
    """In the root process: create the metrics directory, export it, register the collector. Idempotent."""
    global _collector_directory
    if _collector_directory is not None or multiprocessing.parent_process() is not None:
        return  # engine and worker processes inherit the root's directory
    _collector_directory = tempfile.mkdtemp(prefix="vllm-msa-metrics-")
    atexit.register(shutil.rmtree, _collector_directory, True)
    os.environ[DIR_ENV] = _collector_directory
    REGISTRY.register(MSACollector(_collector_directory))
