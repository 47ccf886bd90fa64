"""Where a served decode step's time goes: the kernels of one engine step, as `vllm serve` would run them.

    python3 -m bench.profile_served_decode MODEL_DIR [--context 32768] [--batch 1] [--steps 16] [--top 25]
        [--layer-marker KERNEL] [--trace FILE.json] [-- vllm serve flags, e.g. --attention-backend FLASH_MSA]

Builds vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees its GPU work) from the
same flags `vllm serve` takes, adds --batch requests of --context random prompt tokens (greedy, ignoring EOS), steps
the engine until every request has its first token (the prefills) and 4 decode steps more (warm-up), then profiles
--steps decode steps with torch.profiler. Printed: wall time per step (what a token's ITL is made of; each step
synchronised, so its host work and its GPU work add up), the GPU time per step summed over kernels and the kernel
count per step (and of them PyTorch's own, at::native, kernels: the small tensor ops between the fused ones), then the
--top kernels by GPU time per step, with their launches per step; then the host's side the same way: the --top CPU
ops (self time, calls per step), where the step's Python work and its launches show.
Decode steps replay vLLM's CUDA graphs as served; the profiler records the kernels inside them.
--layer-marker names a kernel launched once per layer (a substring of its name; on MiniMax-M3 checkpoints
fusedMiniMaxM3RowGroup, the norm + RoPE of every layer): then the times from one marker's start to the next (a
layer's period: median, min, max) and a period of the median length kernel by kernel (start, duration, end,
relative to its marker), which shows the gaps and the overlap of dependent launches that summed kernel times hide (on a
machine without CUDA: CPU ops, nested ones included).
On a machine without CUDA it profiles the CPU ops instead (self CPU time), which is what the CPU engine runs.

Issue 45: where a cell of serve/bench_e2e.py loses, this on both servers' flags (FLASH_MSA and vLLM's M3 path, the
same checkpoint) shows where the time goes. --trace writes the Chrome trace for a closer look.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

WARMUP_DECODE_STEPS = 4


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    ours, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=25, help="kernels (CPU ops) listed")
    parser.add_argument("--layer-marker", help="a kernel launched once per layer: print a layer's timeline")
    parser.add_argument("--trace", help="write the profile's Chrome trace here")
    opts = parser.parse_args(ours)
    for name in ("context", "batch", "steps"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(opts, name)}")
    return opts, engine


def build_engine(model_dir: str, context: int, batch: int, steps: int, engine_flags: list[str]):
    """vLLM's engine from `vllm serve` flags, sized for the run unless the flags say otherwise."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    load_general_plugins()  # as `vllm serve` does first: FLASH_MSA's name must be known when the flags are read

    defaults = ["--max-model-len", str(context + steps + WARMUP_DECODE_STEPS + 8), "--max-num-seqs", str(batch)]
    given = {flag.split("=")[0] for flag in engine_flags if flag.startswith("--")}
    flags = [f for i in range(0, len(defaults), 2) if defaults[i] not in given for f in defaults[i : i + 2]]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model_dir, "--no-enable-prefix-caching", *flags, *engine_flags])
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


def add_requests(engine, context: int, batch: int, max_tokens: int, vocab_size: int) -> None:
    import random

    from vllm import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for r in range(batch):
        tokens = [rng.randrange(5, vocab_size) for _ in range(context)]
        engine.add_request(f"profile-{r}", {"prompt_token_ids": tokens}, params)


def step_until_decoding(engine, batch: int) -> int:
    """Engine steps until every request has produced a token (its prefill done); how many steps that took."""
    started: set[str] = set()
    steps = 0
    while len(started) < batch:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished before all of them started decoding")
        for output in engine.step():
            if output.outputs and output.outputs[0].token_ids:
                started.add(output.request_id)
        steps += 1
    return steps


def short_name(name: str) -> str:
    """A kernel's name cut to 90 characters for a table row."""
    return name if len(name) <= 90 else name[:87] + "..."


def kernel_table(events, steps: int, on_gpu: bool, top: int) -> str:
    """Per step: GPU time and launches of each kernel (on_gpu), else self CPU time and calls of each CPU op."""
    from torch.autograd import DeviceType

    time_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in events:
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            time_us[event.name] += event.time_range.elapsed_us()
        else:
            if event.device_type != DeviceType.CPU:
                continue
            time_us[event.name] += event.self_cpu_time_total
        calls[event.name] += 1
    total = sum(time_us.values())
    what = "kernel" if on_gpu else "CPU op"
    lines = [
        f"{'GPU' if on_gpu else 'self CPU'} time per step: {total / steps:.1f} us in {sum(calls.values()) / steps:.1f} "
        f"{what} calls",
    ]
    if on_gpu:  # PyTorch's own kernels: the small tensor ops a model or a plugin runs between the fused kernels
        native = [name for name in time_us if "at::native" in name]
        lines.append(
            f"of them PyTorch's own (at::native): {sum(time_us[n] for n in native) / steps:.1f} us in "
            f"{sum(calls[n] for n in native) / steps:.1f} kernel calls"
        )
    lines += [
        f"| {what} | us per step | share | calls per step |",
        "|---|---|---|---|",
    ]
    for name, us in sorted(time_us.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| `{short_name(name)}` | {us / steps:.2f} | {us / total:.1%} | {calls[name] / steps:.1f} |")
    return "\n".join(lines)


def layer_timeline(kernels: list[tuple[str, float, float]], marker: str) -> str:
    """kernels: (name, start us, duration us) of the profiled kernels. The periods between consecutive launches of
    the marker kernel (median, min, max), then a period of the median length kernel by kernel, relative to its
    marker."""
    kernels = sorted(kernels, key=lambda kernel: kernel[1])
    marks = [i for i, (name, _, _) in enumerate(kernels) if marker in name]
    if len(marks) < 2:
        return f"layer timeline: the marker {marker!r} ran {len(marks)} time(s), a period needs 2"
    periods = sorted((kernels[b][1] - kernels[a][1], a, b) for a, b in zip(marks, marks[1:]))
    median, first, last = periods[len(periods) // 2]
    origin = kernels[first][1]
    lines = [
        f"layer period (marker {marker!r}, {len(periods)} periods): median {median:.2f} us, min {periods[0][0]:.2f} "
        f"us, max {periods[-1][0]:.2f} us; a period of the median length:",
        "| start us | duration us | end us | kernel |",
        "|---|---|---|---|",
    ]
    for name, start, duration in kernels[first : last + 1]:
        end = start + duration - origin
        lines.append(f"| {start - origin:.2f} | {duration:.2f} | {end:.2f} | `{short_name(name)}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts, engine_flags = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, profiled
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    max_tokens = 1 + WARMUP_DECODE_STEPS + opts.steps + 1
    engine = build_engine(opts.model_dir, opts.context, opts.batch, opts.steps, engine_flags)
    vocab_size = engine.vllm_config.model_config.get_vocab_size()
    add_requests(engine, opts.context, opts.batch, max_tokens, vocab_size)
    started = time.perf_counter()
    prefill_steps = step_until_decoding(engine, opts.batch)
    print(f"prefill: {prefill_steps} steps, {time.perf_counter() - started:.2f} s", flush=True)
    for _ in range(WARMUP_DECODE_STEPS):
        engine.step()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    wall = []
    with profile(activities=activities) as prof:
        for _ in range(opts.steps):
            started = time.perf_counter()
            engine.step()
            if on_gpu:
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - started)
    if opts.trace:
        prof.export_chrome_trace(opts.trace)
    wall.sort()
    print(
        f"{opts.steps} decode steps of {opts.batch} x {opts.context} tokens ({' '.join(engine_flags) or 'defaults'}): "
        f"wall per step median {wall[len(wall) // 2] * 1e3:.2f} ms, min {wall[0] * 1e3:.2f} ms (under the profiler)"
    )
    print(kernel_table(prof.events(), opts.steps, on_gpu, opts.top), flush=True)
    if on_gpu:  # and what the host does each step: the time the GPU idles between synchronised steps
        print(kernel_table(prof.events(), opts.steps, False, opts.top), flush=True)
    if opts.layer_marker:
        from torch.autograd import DeviceType

        device = DeviceType.CUDA if on_gpu else DeviceType.CPU
        kernels = [
            (event.name, event.time_range.start, event.time_range.elapsed_us())
            for event in prof.events()
            if event.device_type == device
        ]
        print(layer_timeline(kernels, opts.layer_marker), flush=True)
    while engine.has_unfinished_requests():  # the requests end as they would on a server
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
