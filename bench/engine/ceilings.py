"""`pdcluster bench ceilings`: this machine's roofs, measured with plain torch.

- copy bandwidth: ``dst.copy_(src)`` on a tensor far larger than the caches; bytes counted
  are read + written (2 x size), the convention of STREAM's "copy".
- GEMV bandwidth: one input row through each linear path the engine can take (``F.linear``,
  ``mm(W, x.T)``, oneDNN's inner product: ``engine.ops.linear``), the fastest on this host; bytes
  counted are the weight matrix (what a batch-1 decode step streams). This is the decode
  floor's denominator, so the floor is the best this torch does.
- the engine's linear-kernel plan for the default model (``engine.tuning.linear``): which of the
  two paths it takes per weight shape and batch size on this host, and by how much.
- the fused CPU kernels (``engine.ops.cpu_ops``): built for this host or not, and the decode
  attention path the engine takes per batch and context (timed at start-up, cached).
- matmul rate: a large square fp32 matmul, 2 n^3 FLOPs, by MKL (``a @ b``) and by oneDNN,
  the faster (on an AMD EPYC with AVX-512, oneDNN ran it ~2x faster than MKL).

Each figure is the median of ``repeats`` timed runs after one warm-up, so a noisy neighbour
moves it less than a mean would.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.harness.report import machine_info, write_json


@dataclass(frozen=True)
class Ceilings:
    """Measured roofs (medians) and the sizes they were measured at."""

    copy_bytes_per_s: float  # read + written
    gemv_bytes_per_s: float  # weight bytes streamed
    matmul_flops_per_s: float  # fp32
    copy_size_bytes: int
    gemv_shape: tuple[int, int]
    matmul_n: int
    repeats: int
    num_threads: int


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, oneDNN primitive creation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_copy(n: int, repeats: int) -> float:
    import torch

    src = torch.rand(n)  # [n]
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), repeats)


def _time_gemv(rows: int, cols: int, repeats: int) -> float:
    import torch

    from engine.ops.linear import available_paths, linear_by_path

    w = torch.rand(rows, cols)  # [out, in]
    x = torch.rand(1, cols)  # [1, in]: one decode row
    return min(_median_time(lambda p=p: linear_by_path(p, x, w, None), repeats) for p in available_paths())


def _time_matmul(n: int, repeats: int) -> float:
    import torch

    from engine.ops.linear import available_paths

    a = torch.rand(n, n)
    b = torch.rand(n, n)
    best = _median_time(lambda: a @ b, repeats)
    if "onednn" in available_paths():  # oneDNN picks kernels by the CPU's instructions, MKL not on AMD
        bt = b.t().contiguous()  # [out, in], as a weight
        best = min(best, _median_time(
            lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], ""), repeats))
    return best


def measure_ceilings(copy_mib: int = 256, gemv_rows: int = 8192, gemv_cols: int = 8192,
                     matmul_n: int = 2048, repeats: int = 7) -> Ceilings:
    """Measure copy / GEMV bandwidth and matmul rate (fp32). Sizes should exceed the LLC."""
    import torch

    if min(copy_mib, gemv_rows, gemv_cols, matmul_n, repeats) <= 0:
        raise ValueError("sizes and repeats must be > 0")
    n = copy_mib * (1 << 20) // 4
    with torch.inference_mode():
        copy_s = _time_copy(n, repeats)
        gemv_s = _time_gemv(gemv_rows, gemv_cols, repeats)
        mm_s = _time_matmul(matmul_n, repeats)
    gemv_bytes = gemv_rows * gemv_cols * 4
    return Ceilings(
        copy_bytes_per_s=2 * n * 4 / copy_s,
        gemv_bytes_per_s=gemv_bytes / gemv_s,
        matmul_flops_per_s=2.0 * matmul_n ** 3 / mm_s,
        copy_size_bytes=n * 4, gemv_shape=(gemv_rows, gemv_cols), matmul_n=matmul_n,
        repeats=repeats, num_threads=torch.get_num_threads())


def quick_ceilings() -> Ceilings:
    """Smaller sizes for ``--quick`` runs and for the sweep's roofline (a few seconds)."""
    return measure_ceilings(copy_mib=128, gemv_rows=4096, gemv_cols=8192, matmul_n=2048,
                            repeats=3)


def format_ceilings(c: Ceilings) -> str:
    return (f"copy {c.copy_bytes_per_s / 1e9:.1f} GB/s (read+write), "
            f"GEMV {c.gemv_bytes_per_s / 1e9:.1f} GB/s, "
            f"matmul {c.matmul_flops_per_s / 1e9:.1f} GFLOP/s (fp32, {c.num_threads} threads)")


def _default_model():
    import torch

    from engine.models.llama import LlamaForCausalLM
    from engine.weights.loader import load_state_dict
    from engine.weights.resolve import load_model_config, resolve_model

    model_dir = resolve_model(None).model_dir
    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    return model


def default_model_linear_plan(model=None):
    """The engine's per-host linear-kernel plan for the default model (cached, or timed now
    on its weights exactly as an engine starting on this host would: engine.tuning.linear)."""
    from engine.tuning.linear import model_linear_weights, tune_linear

    return tune_linear(model_linear_weights(model or _default_model()))


def fused_kernels_and_decode_paths():
    """Where this host's fused-kernel library is (or why not), and the decode and prefill
    attention paths the engine times for the default model's attention shapes."""
    import torch

    from engine.attention.torch_tuning import tune_decode_paths, tune_prefill_paths
    from engine.config import CacheConfig
    from engine.ops import cpu_ops
    from engine.weights.resolve import load_model_config, resolve_model

    lib = cpu_ops.library()
    kernels = lib._name if lib is not None else "not built (torch paths serve; see the log)"
    cfg = load_model_config(resolve_model(None).model_dir)
    decode = tune_decode_paths(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               CacheConfig().block_size, torch.float32)
    prefill = tune_prefill_paths(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return kernels, decode, prefill


def fused_decode_plan(model, linear_plan, decode_paths):
    """Per batch bucket, whether the engine runs the default model's pure-decode steps as one
    fused call on this host (engine.tuning.fused_decode; timed against the layers as they run)."""
    from engine.config import CacheConfig
    from engine.ops.linear import set_linear_plan
    from engine.tuning.fused_decode import tune_fused_decode

    set_linear_plan(linear_plan)
    return tune_fused_decode(model, CacheConfig().block_size, decode_paths)


def run(args: argparse.Namespace) -> dict:
    """Entry point of the ``ceilings`` subcommand; returns the JSON payload it wrote."""
    print("measuring ceilings (copy, GEMV, matmul)...", flush=True)
    c = quick_ceilings() if args.quick else measure_ceilings(repeats=args.repeats)
    print("  " + format_ceilings(c), flush=True)
    model = _default_model()
    plan = default_model_linear_plan(model)
    src = "cached for this host" if plan.from_cache else "timed now"
    print(f"linear kernels the engine uses on this host (default model, {src}; "
          "path per batch size, and how much faster than the other):", flush=True)
    for line in plan.summary():
        print("  " + line, flush=True)
    kernels, decode, prefill = fused_kernels_and_decode_paths()
    print(f"fused CPU kernels (engine.ops.cpu_ops): {kernels}", flush=True)
    print("decode attention path per batch and context (and how much faster than the "
          "runner-up):", flush=True)
    for line in decode.summary():
        print("  " + line, flush=True)
    print("prefill attention path per KV length (and how much faster than the other):",
          flush=True)
    for line in prefill.summary() or ["torch's scaled_dot_product_attention (no fused kernels here)"]:
        print("  " + line, flush=True)
    fused = fused_decode_plan(model, plan, decode)
    print("pure-decode step per batch bucket: layer by layer, or every layer in one fused call "
          "(engine.executor.fused_decode; the faster is used):", flush=True)
    for line in fused.summary() or ["not offered (no fused kernels here)"]:
        print("  " + line, flush=True)
    payload = {"benchmark": "ceilings", "machine": machine_info(), "ceilings": c,
               "copy_gb_s": c.copy_bytes_per_s / 1e9, "gemv_gb_s": c.gemv_bytes_per_s / 1e9,
               "matmul_gflop_s": c.matmul_flops_per_s / 1e9,
               "linear_plan": {"host_key": plan.key, "from_cache": plan.from_cache,
                               "summary": plan.summary(), "timings": plan.timings},
               "fused_cpu_kernels": kernels,
               "decode_paths": {"summary": decode.summary(), "timings": decode.timings},
               "prefill_paths": {"summary": prefill.summary(), "timings": prefill.timings},
               "fused_decode": {"summary": fused.summary(), "timings": fused.timings}}
    path = write_json(args.out, "ceilings", payload)
    print(f"wrote {path}")
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=7, help="timed runs per figure (median kept)")
