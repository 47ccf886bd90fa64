"""bench/profile_served_decode.py on the CPU engine: the demo model's decode steps profiled, each MSA layer once a
step, and bad arguments refused. The engine runs in the tool's own process (it builds vLLM's engine core in-process,
whose globals must not leak into the test process)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench import profile_served_decode

ROOT = Path(__file__).resolve().parents[1]


def test_profiles_decode_steps_with_each_msa_layer_called_once_a_step(demo_model):
    flags = ["--dtype", "float32", "--kv-cache-memory-bytes", "1G", "--enforce-eager"]
    command = [sys.executable, "-m", "bench.profile_served_decode", str(demo_model), "--context", "300", "--steps", "2"]
    command += ["--layer-marker", "vllm_msa::msa_attention"]
    run = subprocess.run([*command, "--", *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "2 decode steps of 1 x 300 tokens" in run.stdout
    [row] = [line for line in run.stdout.splitlines() if line.startswith("| `vllm_msa::msa_attention` |")]
    assert row.endswith("| 3.0 |"), row  # the demo's 3 MSA layers (layer 0 is dense), once each per step
    assert "layer period (marker 'vllm_msa::msa_attention', 5 periods)" in run.stdout  # 2 steps x 3 layers


def test_layer_timeline_gives_the_periods_and_one_of_median_length_relative_to_its_marker():
    kernels = [("norm", 0.0, 2.0), ("attn", 3.0, 4.0), ("norm", 10.0, 2.0), ("attn", 12.5, 1.0), ("norm", 30.0, 1.0)]
    kernels += [("attn", 31.0, 2.0), ("norm", 42.0, 1.0)]  # periods 10, 20, 12: the median one is 30 -> 42
    text = profile_served_decode.layer_timeline(kernels[::-1], "norm")  # any order: sorted by start
    assert "3 periods): median 12.00 us, min 10.00 us, max 20.00 us" in text
    assert text.splitlines()[-3:] == [
        "| 0.00 | 1.00 | 1.00 | `norm` |",
        "| 1.00 | 2.00 | 3.00 | `attn` |",
        "| 12.00 | 1.00 | 13.00 | `norm` |",
    ]
    assert "ran 1 time(s), a period needs 2" in profile_served_decode.layer_timeline(kernels[:2], "norm")


def test_kernel_table_counts_pytorchs_own_kernels_apart():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def kernel(name: str, us: float):
        elapsed = SimpleNamespace(elapsed_us=lambda: us)
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=elapsed)

    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>"
    events = [kernel("fused_moe_kernel", 10.0), kernel(fill, 1.5), kernel(fill, 2.5), kernel("topk", 4.0)]
    events.append(SimpleNamespace(name="aten::fill_", device_type=DeviceType.CPU))  # a CPU op: not a kernel
    lines = profile_served_decode.kernel_table(events * 2, steps=2, on_gpu=True, top=2).splitlines()
    assert lines[:2] == [
        "GPU time per step: 18.0 us in 4.0 kernel calls",
        "of them PyTorch's own (at::native): 4.0 us in 2.0 kernel calls",
    ]
    assert lines[-2:] == ["| `fused_moe_kernel` | 10.00 | 55.6% | 1.0 |", f"| `{fill}` | 4.00 | 22.2% | 2.0 |"]


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--batch", "0"], ["--context", "-1"]])
def test_bad_sizes_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        profile_served_decode.parse_args(["model", *bad])
    assert "must be at least 1" in capsys.readouterr().err
