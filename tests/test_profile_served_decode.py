"""bench/profile_served_decode.py on the CPU engine: the demo model's decode steps profiled, each MSA layer once a
step, and bad arguments refused."""

import pytest

from bench import profile_served_decode


def test_profiles_decode_steps_with_each_msa_layer_called_once_a_step(demo_model, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as main sets it, undone after the test
    flags = ["--dtype", "float32", "--kv-cache-memory-bytes", "1G", "--enforce-eager"]
    assert profile_served_decode.main([str(demo_model), "--context", "300", "--steps", "2", "--", *flags]) == 0
    printed = capsys.readouterr().out
    assert "2 decode steps of 1 x 300 tokens" in printed
    [row] = [line for line in printed.splitlines() if line.startswith("| `vllm_msa::msa_attention` |")]
    assert row.endswith("| 3.0 |"), row  # the demo's 3 MSA layers (layer 0 is dense), once each per step


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--batch", "0"], ["--context", "-1"]])
def test_bad_sizes_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        profile_served_decode.parse_args(["model", *bad])
    assert "must be at least 1" in capsys.readouterr().err
