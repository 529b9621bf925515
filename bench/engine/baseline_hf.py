"""Transformers baselines on the same weights and the same token-id workloads as our engine.

- ``run_static``: ``model.generate`` on left-padded batches taken in arrival order, greedy,
  ``min_new_tokens == max_new_tokens`` so every row produces exactly the batch's longest
  length (a row's tokens past its own length are waste, as under static batching).
- ``run_generate_batch``: transformers' continuous-batching ``generate_batch`` (5.x), with its
  per-token timestamps. If the installed version lacks it or it fails on this machine, the
  result carries ``error`` instead of figures; the caller records why.

The weights are loaded from the directory our engine loads (``resolve_model(...).model_dir``:
the converted GGUF for the default model), so both sides compute the same function.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness.stats import summarize


@dataclass
class HFRunResult:
    """One transformers run over a workload. Times are seconds; ``error`` set means it did not run."""

    method: str  # "static_generate" | "generate_batch"
    batch_size: int
    num_requests: int
    useful_tokens: int = 0  # tokens each request asked for (padding rows' extra tokens excluded)
    generated_tokens: int = 0  # everything the model produced, waste included
    elapsed_s: float = 0.0
    throughput_tok_s: float = 0.0  # useful tokens / elapsed
    mean_latency_s: float = 0.0  # mean end-to-end over requests (all queued at t=0)
    e2e_p99_s: float = 0.0
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    itl_mean_s: float | None = None  # static: batch time / tokens per row
    itl_p99_s: float | None = None
    num_steps: int = 0  # static: sum of each batch's max_new_tokens
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def load_hf_model(model: str | None) -> Any:
    """Load transformers' model from the directory our engine resolves ``model`` to (fp32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.weights.resolve import resolve_model

    model_dir = resolve_model(None if model in (None, "default") else model).model_dir
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def pad_id(hf_model: Any) -> int:
    cfg = hf_model.config
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        eos = getattr(cfg, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else eos
    return int(pad) if pad is not None else 0


def run_static(hf_model: Any, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
               batch_size: int, warmup: bool = True) -> HFRunResult:
    """Static batched ``generate``: batches of ``batch_size`` in order, run to their longest length."""
    import torch

    if len(prompts) != len(output_lens) or not prompts:
        raise ValueError("need one output length per prompt, and at least one prompt")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    pad = pad_id(hf_model)

    def generate(batch: Sequence[Sequence[int]], new_tokens: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, width], left-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(list(p))
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    if warmup:
        generate([prompts[0]], 2)
    res = HFRunResult("static_generate", batch_size, len(prompts))
    latencies: list[float] = []
    itls: list[float] = []
    t0 = prev = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        lens = output_lens[i:i + batch_size]
        new_tokens = max(lens)
        res.generated_tokens += generate(batch, new_tokens)
        done = time.perf_counter()
        res.num_steps += new_tokens
        latencies.extend([done - t0] * len(batch))
        itls.extend([(done - prev) / new_tokens] * len(batch))
        prev = done
    res.elapsed_s = time.perf_counter() - t0
    res.useful_tokens = sum(output_lens)
    res.throughput_tok_s = res.useful_tokens / res.elapsed_s
    lat = summarize(latencies)
    res.mean_latency_s, res.e2e_p99_s = lat.mean, lat.p99
    it = summarize(itls)
    res.itl_mean_s, res.itl_p99_s = it.mean, it.p99
    res.notes.append("no per-token timestamps from generate(): ITL = batch time / new tokens")
    return res


def run_generate_batch(hf_model: Any, prompts: Sequence[Sequence[int]], output_len: int,
                       max_batch: int, block_size: int = 16) -> HFRunResult:
    """transformers' continuous batching (``generate_batch``), every request ``output_len`` long."""
    res = HFRunResult("generate_batch", max_batch, len(prompts))
    if not hasattr(hf_model, "generate_batch"):
        import transformers

        res.error = f"transformers {transformers.__version__} has no generate_batch"
        return res
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        longest = max(len(p) for p in prompts) + output_len
        blocks_per_req = -(-longest // block_size)
        gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                               do_sample=False, eos_token_id=None, pad_token_id=pad_id(hf_model))
        # Sized explicitly: its defaults are inferred from free GPU memory.
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=max_batch, page_size=block_size,
            num_blocks=blocks_per_req * max_batch + 1,
            max_batch_tokens=max(longest * max_batch, 256))
        hf_model.generate_batch(inputs=[list(prompts[0])], generation_config=gen,
                                continuous_batching_config=cb)  # warm-up
        t0 = time.perf_counter()
        outs = hf_model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gen,
                                       continuous_batching_config=cb, record_timestamps=True)
        res.elapsed_s = time.perf_counter() - t0
    except Exception as e:  # a baseline failing must not sink our own figures
        res.error = f"{type(e).__name__}: {e}"
        return res
    errors = [o.error for o in outs.values() if o.error]
    if errors:
        res.error = f"{len(errors)} requests failed: {errors[0]}"
        return res
    ttfts, itls, e2es = [], [], []
    for o in outs.values():
        res.generated_tokens += len(o.generated_tokens)
        ts = o.timestamps or []
        # All requests were queued at t0 (the timestamps are perf_counter, like t0).
        if ts:
            ttfts.append(ts[0] - t0)
            itls.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
        e2es.append(o.lifespan[1] - t0)
    res.useful_tokens = min(res.generated_tokens, output_len * len(prompts))
    res.throughput_tok_s = res.useful_tokens / res.elapsed_s
    e2e = summarize(e2es)
    res.mean_latency_s, res.e2e_p99_s = e2e.mean, e2e.p99
    if ttfts:
        t = summarize(ttfts)
        res.ttft_mean_s, res.ttft_p99_s = t.mean, t.p99
    if itls:
        it = summarize(itls)
        res.itl_mean_s, res.itl_p99_s = it.mean, it.p99
    return res
