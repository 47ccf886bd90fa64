"""Configurations FLASH_MSA cannot serve stop `bash serve/demo.sh` at start-up, before any engine process
starts, with an error naming the fix (the check runs while vLLM builds its config)."""

import json
import subprocess
from pathlib import Path

import pytest

from vllm_msa.checkpoint import DEFAULT_CONFIG

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MSA = DEFAULT_CONFIG["msa_config"]


def _hf_overrides(**msa_fields) -> list[str]:
    return ["--hf-overrides", json.dumps({"msa_config": MSA | msa_fields})]


# One case per source of the error: vLLM flags, a model field (through --hf-overrides), the checkpoint itself.
# tests/test_plugin.py checks every message of those checks in-process.
BAD_CONFIGS = {
    "a KV cache format FLASH_MSA does not serve": (
        ["--kv-cache-dtype", "fp8_e5m2"],
        "--kv-cache-dtype fp8_e5m2 is not served",
    ),
    "index heads not a multiple of the KV heads": (
        _hf_overrides(num_index_heads=3),
        "msa_config does not fit this model: invalid MSA shape: num_index_heads 3 must be a multiple of num_kv_heads 2",
    ),
    "a KV connector not verified to carry the index-key caches (NIXL)": (
        ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})],
        "--kv-transfer-config runs KV connector NixlConnector, which is not verified to carry FLASH_MSA's caches",
    ),
    "a host tier smaller than one decode step's pages": (
        ["--max-num-seqs", "4", "--additional-config", json.dumps({"flash_msa_kv_device_pages": 8})],
        "8 device pages cannot hold one decode step's pages: --max-num-seqs 4 requests x 4 index heads x top-4 = 64",
    ),
    "FlashMSAForCausalLM without msa_config": (
        ["--hf-overrides", json.dumps({"msa_config": None})],
        "this checkpoint has no 'msa_config' in config.json",
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_unservable_config_stops_the_server_with_a_clear_error(case):
    flags, message = BAD_CONFIGS[case]
    out = subprocess.run(
        ["bash", "serve/demo.sh", "--port", "1", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert message in log, log[-3000:]
    assert "EngineCore" not in log  # refused before any engine process started
