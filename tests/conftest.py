"""Shared fixtures: the demo checkpoint, built once per test session."""

import pytest

from serve.build_demo_model import build_demo_model


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo-msa")
