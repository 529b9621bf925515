"""The KV page pool's memory (engine/executor/kv_pages.py): zeroed, page aligned, and on the
host resident only once written."""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs
from engine.executor.kv_pages import zeroed_kv_pages
from engine.runtime.llm_engine import LLMEngine

CPU = torch.device("cpu")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_pages_are_zero_aligned_and_writable(dtype):
    pages = zeroed_kv_pages((10, 2, 16, 3, 64), dtype, CPU)
    assert pages.shape == (10, 2, 16, 3, 64) and pages.dtype == dtype and pages.is_contiguous()
    assert pages.data_ptr() % 4096 == 0  # page aligned: every SIMD width's loads are aligned
    assert not pages.any()
    pages[3, 1] = 1
    assert int(pages.to(torch.int64).sum()) == 16 * 3 * 64
    view = pages[3]
    del pages  # a view keeps the mapping alive
    assert int(view.to(torch.int64).sum()) == 16 * 3 * 64


def test_a_pool_is_resident_only_where_written():
    size = 512 << 20
    before = _rss_bytes()
    pages = zeroed_kv_pages((size // 4096, 1024), torch.float32, CPU)  # 512 MiB
    assert _rss_bytes() - before < 32 << 20, "the pool was resident before anything was written"
    pages[:64] = 1.0  # 64 pages of 4 KiB
    assert 0 < _rss_bytes() - before < 32 << 20
    assert float(pages.sum()) == 64 * 1024


def test_an_engine_with_the_default_pool_starts_without_it_resident(tiny_llama_dir):
    """The CPU default pool is 1 GiB (engine/executor/device.py); a tiny model's engine must
    not hold it resident before a request, and serves from it as before."""
    before = _rss_bytes()
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir)))
    assert engine.runner.kv_cache_bytes >= 1 << 30
    assert _rss_bytes() - before < 256 << 20
    del engine
