"""Shared fixtures: the demo checkpoint and the M3-attention-shaped MiniMax-M3 checkpoint, built once per test
session."""

import os

import pytest
import torch

# CuTeDSL reads its target arch once, when first used: without a GPU (CI), make it Hopper before
# any test (or vLLM, which imports CuTeDSL itself) gets there, so every kernel compiles for sm_90a.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from serve.build_demo_model import build_demo_model
from serve.build_m3_model import PRESETS, build_m3_model


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo-msa")


@pytest.fixture(scope="session")
def m3_attention_model(tmp_path_factory):
    """serve/build_m3_model.py --preset m3-attention: MiniMax-M3's attention shapes, 1 dense + 3 sparse layers."""
    return build_m3_model(tmp_path_factory.mktemp("models") / "m3-attention", **PRESETS["m3-attention"])
