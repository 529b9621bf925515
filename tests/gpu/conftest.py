"""GPU-test fixtures: a tiny model FlashInfer can run (head_dim 64)."""

from __future__ import annotations

import pytest

from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(tmp_path_factory):
    """The tiny Llama with head_dim 64 (4 query heads over 2 KV heads): the shared tiny model
    has head_dim 16, which FlashInfer has no kernels for."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-hd64"), hidden_size=256,
                           intermediate_size=512)
