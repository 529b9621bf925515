"""Shared fixtures: tiny random Llama-family models saved to disk with transformers."""

from __future__ import annotations

import pytest

from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    return save_tiny_model("mistral", tmp_path_factory.mktemp("tiny-mistral"))
