"""Start-up timing of the torch backend's paths on this host: causal prefill attention (SDPA
against ``cpu_ops.prefill_attention``) and batched decode (``"gather"``, ``"rows"``, the fused
C kernel), cached per host like the linear kernels (``engine.tuning.cache.cached_timings``). The
backend runs what these choose (``TorchPagedBackend.prefill_paths`` / ``.decode_paths``)."""

from __future__ import annotations

import statistics
import time

import torch

from engine.attention.torch_paged import (
    CONTEXT_BUCKETS,
    DECODE_PATHS,
    PREFILL_BUCKETS,
    PREFILL_PATHS,
    DecodePaths,
    PrefillPaths,
    TorchPagedBackend,
    sdpa_prefill,
)
from engine.ops import cpu_ops
from engine.ops.linear import M_BUCKETS


def tune_prefill_paths(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       cache_dir: str | None = None) -> PrefillPaths:
    """Time causal prefill attention, torch's SDPA against ``cpu_ops.prefill_attention``, on
    fresh prompts of each ``PREFILL_BUCKETS`` length for these head shapes (interleaved,
    median of 5; cached per host like the other plans, under a second here). Only SDPA where
    the kernel is not built: an empty plan."""
    from engine.tuning.cache import Timing, cached_timings, host_key

    probe = torch.zeros(1, num_heads, head_dim, dtype=dtype)
    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype)
    if not cpu_ops.prefill_attention(probe, kv, kv, 0, torch.empty_like(probe)):
        return PrefillPaths()
    key = host_key([(num_heads, num_kv_heads), (head_dim, 0)]
                   + [(n, 0) for n in PREFILL_BUCKETS], dtype,
                   "prefill|" + ",".join(PREFILL_PATHS) + "|" + cpu_ops.build_id())

    def measure() -> list[Timing]:
        out = []
        for length in PREFILL_BUCKETS:
            q = torch.randn(length, num_heads, head_dim, dtype=dtype)
            k = torch.randn(length, num_kv_heads, head_dim, dtype=dtype)
            v = torch.randn(length, num_kv_heads, head_dim, dtype=dtype)
            o = torch.empty_like(q)
            calls = {"sdpa": lambda q=q, k=k, v=v: sdpa_prefill(q, k, v, None),
                     "fused": lambda q=q, k=k, v=v, o=o: cpu_ops.prefill_attention(q, k, v, 0, o)}
            times: dict[str, list[float]] = {p: [] for p in PREFILL_PATHS}
            for r in range(6):  # round 0 warms up, untimed
                for path in PREFILL_PATHS:
                    t0 = time.perf_counter()
                    calls[path]()
                    if r:
                        times[path].append(time.perf_counter() - t0)
            out.append(Timing(length, 0, 1, {p: statistics.median(t) for p, t in times.items()}))
        return out

    timings, from_cache = cached_timings("prefill-attention", key, measure, cache_dir)
    return PrefillPaths({t.n: t.best for t in timings}, timings, from_cache)


def tune_decode_paths(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, cache_dir: str | None = None) -> DecodePaths:
    """Time the decode paths on this host for every batch bucket and context bucket (cached
    per host like the linear kernels: ``engine.tuning.cache.cached_timings``; about a second).
    ``"fused"`` is offered only where ``engine.ops.cpu_ops`` is built and takes these shapes."""
    from engine.attention.backend import SeqSlice, build_metadata
    from engine.tuning.cache import Timing, cached_timings, host_key

    paths = [p for p in DECODE_PATHS if p != "fused"
             or cpu_ops.decode_applies(num_heads, num_kv_heads, head_dim, dtype)]
    shape = [(num_heads, num_kv_heads), (head_dim, block_size)]
    # The offered paths and the kernel library's build are part of the key: a host that gains
    # the kernel, or a new build of it, times again.
    key = host_key(shape + [(c, 0) for c in CONTEXT_BUCKETS], dtype,
                   ",".join(paths) + "|" + cpu_ops.build_id())

    def measure() -> list[Timing]:
        pages_per_seq = CONTEXT_BUCKETS[-1] // block_size
        num_pages = M_BUCKETS[-1] * pages_per_seq + 1
        cache = torch.randn(num_pages, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
        out = []
        for batch in M_BUCKETS:
            q = torch.randn(batch, num_heads, head_dim, dtype=dtype)
            for ctx in CONTEXT_BUCKETS:
                seqs = [SeqSlice(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq),
                                 ctx - 1, 1) for i in range(batch)]
                meta = build_metadata(seqs, block_size)
                seconds = {}
                out_buf = torch.empty_like(q)
                for path in paths:
                    backend = TorchPagedBackend()
                    backend.decode_paths = DecodePaths({(batch, ctx): path})
                    backend.plan(meta)

                    def call(backend=backend, q=q, out_buf=out_buf):
                        backend.attend_decode_rows(q, cache, out_buf)

                    call()
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    seconds[path] = sorted(times)[1]
                out.append(Timing(ctx, num_kv_heads * head_dim, batch, seconds))
        return out

    timings, from_cache = cached_timings("decode", key, measure, cache_dir)
    return DecodePaths({(t.m, t.n): t.best for t in timings}, timings, from_cache)
