"""Device selection is explicit and refuses what the machine cannot do."""

from __future__ import annotations

import pytest
import torch

from engine.executor.device import (
    kv_pool_bytes,
    resolve_attention_backend,
    resolve_cuda_graphs,
    resolve_device,
    resolve_dtype,
)


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on CPU-only machines")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_unknown_device():
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("mps")


# ---- every "auto" resolved once (engine.executor.device) ---------------------------------------------
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_dtype_auto_is_bf16_on_cuda_fp32_on_cpu():
    assert resolve_dtype("auto", CPU.type) == "float32"
    assert resolve_dtype("auto", CUDA.type) == "bfloat16"
    assert resolve_dtype("float16", CUDA.type) == "float16"
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", CPU.type)


@pytest.mark.parametrize("installed", [True, False])
def test_attention_backend_auto(installed):
    have = lambda: installed  # noqa: E731
    assert resolve_attention_backend("auto", CPU, "float32", have) == "torch"
    assert resolve_attention_backend("auto", CUDA, "bfloat16", have) == (
        "flashinfer" if installed else "torch")
    # FlashInfer has no fp32 kernels: fp32 on a GPU (the exactness check) takes torch
    assert resolve_attention_backend("auto", CUDA, "float32", have) == "torch"


def test_flashinfer_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("flashinfer", CPU, "bfloat16", lambda: True)
    with pytest.raises(ValueError, match="pip install 'pdcluster\\[gpu\\]'"):
        resolve_attention_backend("flashinfer", CUDA, "bfloat16", lambda: False)
    with pytest.raises(ValueError, match="no float32 kernels"):
        resolve_attention_backend("flashinfer", CUDA, "float32", lambda: True)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_attention_backend("xformers", CUDA)


def test_cuda_graphs_default_on_for_cuda_only():
    assert resolve_cuda_graphs(None, CPU) is False
    assert resolve_cuda_graphs(None, CUDA) is True
    assert resolve_cuda_graphs(False, CUDA) is False
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        resolve_cuda_graphs(True, CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
def test_engine_refuses_gpu_settings_on_cpu(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(ValueError, match="flashinfer' needs a CUDA device"):
        LLM(str(tiny_llama_dir), attention_backend="flashinfer")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(str(tiny_llama_dir), cuda_graphs=True)


GiB = 2**30


def test_kv_pool_from_gpu_memory():
    # 80 GiB device; this worker's weights hold 2 GiB, 78 GiB are free
    info = lambda _d: (78 * GiB, 80 * GiB, 2 * GiB)  # noqa: E731
    assert kv_pool_bytes(None, CUDA, 0.9, info) == 72 * GiB - 2 * GiB
    # two workers sharing the GPU each pass half the utilization: the same pool, whoever
    # starts first, and both together under the cap
    assert kv_pool_bytes(None, CUDA, 0.45, info) == int(80 * GiB * 0.45) - 2 * GiB
    # never more than 95% of what is free now
    assert kv_pool_bytes(None, CUDA, 1.0, lambda _d: (10 * GiB, 80 * GiB, 2 * GiB)) == int(9.5 * GiB)
    assert kv_pool_bytes(3 * GiB, CUDA, 0.9, info) == 3 * GiB  # an explicit size wins
    assert kv_pool_bytes(None, CPU, 0.9, info) == GiB  # CPU: the 1 GiB default


def test_kv_pool_errors_name_the_setting():
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        kv_pool_bytes(None, CUDA, 0.1, lambda _d: (70 * GiB, 80 * GiB, 9 * GiB))
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in \\(0, 1\\]"):
        kv_pool_bytes(None, CUDA, 1.5)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be > 0"):
        kv_pool_bytes(0, CPU, 0.9)
