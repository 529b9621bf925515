"""Time this host's kernel choices for a model ahead of its first start (``make setup``).

An engine on CPU times its linear-kernel paths (``engine.tuning.linear.tune_linear``) and its decode
attention paths (``tune_decode_paths``), then whether its whole-step decode kernel beats them
(``engine.tuning.fused_decode``), at start-up, once per host, model shapes and torch
thread count, and caches the result. For the default model that first timing is not small: on
a 2-vCPU host it took 30 s at 2 threads and 55 s at 1 thread (every batch bucket, every path,
interleaved repeats over the model's 538 MB), paid by the first ``pdcluster serve`` and, on a
fresh CI machine, by whichever test first starts an engine at each thread count. ``make
setup`` runs this module so that cost is paid at install time, like the fused kernels'
compile: at 1 thread and at every core (``pdcluster serve``'s default counts on machines of
fewer than 8 cores, ``router/cluster/threads.py``; bigger machines time their other counts at the first
start, or pass ``--threads``), the engine then starts from the cache.

    python -m engine.tuning.pretune [--model DIR] [--threads 1,2] [--cache-dir DIR]

(``--cache-dir`` an empty folder: how long a first start's timing takes on this host.)

Never fails the caller: a model that cannot be loaded, or a timing that fails, is logged and
the engine times at its first start as before.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pretuned:
    """One thread count's plans: whether each came from the cache, and the seconds spent."""

    threads: int
    quantization: str  # the weights as served ("gguf", "none", ...)
    linear_from_cache: bool
    decode_from_cache: bool
    fused_from_cache: bool
    seconds: float
    prefill_from_cache: bool = True


def default_thread_counts(cores: int | None = None) -> list[int]:
    """1 (a disaggregated decode worker's share on small machines) and every core (a
    colocated worker's, and a prefill worker's, below 8 cores)."""
    cores = cores or os.cpu_count() or 1
    return sorted({1, cores})


def pretune(model: str | None = None, thread_counts: list[int] | None = None,
            cache_dir: str | None = None,
            quantizations: tuple[str, ...] = ("auto", "none")) -> list[Pretuned]:
    """Time (or find cached) the linear and decode-attention plans of ``model`` (default: the
    default model) at each thread count, exactly as ``LLMEngine`` does at start-up, for the
    weights as each of ``quantizations`` serves them (by default what ``auto`` serves, the
    default model's GGUF blocks, and fp32, once each where they are the same); restores
    torch's thread count afterwards."""
    from engine.config import resolve_quantization
    from engine.models.llama import LlamaForCausalLM
    from engine.weights.loader import has_quantized_blocks, load_weights
    from engine.weights.resolve import load_model_config, resolve_model

    model_dir = resolve_model(model).model_dir
    cfg = load_model_config(model_dir)
    served = dict.fromkeys(resolve_quantization(q, has_quantized_blocks(model_dir), "cpu")
                           for q in quantizations)
    done = []
    for quant in served:
        net = LlamaForCausalLM(cfg)
        load_weights(net, model_dir, quant)
        done += _pretune_model(net, quant, thread_counts, cache_dir)
    return done


def _pretune_model(net, quant: str, thread_counts: list[int] | None,
                   cache_dir: str | None) -> list[Pretuned]:
    from engine.attention.torch_tuning import tune_decode_paths, tune_prefill_paths
    from engine.config import CacheConfig
    from engine.ops.linear import linear_plan, set_linear_plan
    from engine.tuning.fused_decode import tune_fused_decode
    from engine.tuning.linear import model_linear_weights, tune_linear

    cfg = net.cfg
    dtype = getattr(torch, cfg.dtype)
    weights = model_linear_weights(net)
    before, plan_before = torch.get_num_threads(), linear_plan()
    done = []
    try:
        for n in thread_counts or default_thread_counts():
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            linear = tune_linear(weights, cache_dir=cache_dir)
            block_size = CacheConfig().block_size
            decode = tune_decode_paths(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       block_size, dtype, cache_dir=cache_dir)
            prefill = tune_prefill_paths(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype,
                                         cache_dir=cache_dir)
            set_linear_plan(linear)  # the fused step is timed against the layers as they run
            fused = tune_fused_decode(net, block_size, decode, cache_dir=cache_dir)
            done.append(Pretuned(n, quant, linear.from_cache, decode.from_cache,
                                 fused.from_cache, time.perf_counter() - t0,
                                 prefill.from_cache))
    finally:
        torch.set_num_threads(before)
        set_linear_plan(plan_before)
    return done


def _thread_list(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads: positive integers, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tuning.pretune", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF dir or GGUF (default: the default model)")
    p.add_argument("--threads", type=_thread_list, default=None,
                   help=f"comma-separated torch thread counts (default: {default_thread_counts()})")
    p.add_argument("--cache-dir", default=None,
                   help="where the plans are cached (default: the engine's, ~/.cache/pdcluster)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        for r in pretune(args.model, args.threads, args.cache_dir):
            state = ("cached already" if r.linear_from_cache and r.decode_from_cache
                     and r.fused_from_cache and r.prefill_from_cache
                     else f"timed in {r.seconds:.1f} s")
            print(f"kernel plans for {r.threads} thread(s), quantization {r.quantization}: "
                  f"{state}")
    except Exception as e:  # install must not fail here: the engine times at start instead
        log.warning("kernel plans not pre-timed (%s: %s); the engine times them at its first "
                    "start", type(e).__name__, e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
