"""Shared pieces of the engine benchmarks: workloads, statistics, batching arithmetic, output.

Everything here except ``machine_info``, ``write_json`` and the plotting helpers is pure
arithmetic on plain numbers, so the unit tests pin it down without a model:

- workloads: seeded token-id prompts of exact length, heavy-tailed output lengths;
- statistics: ``percentile`` (linear interpolation, numpy's default) and ``summarize``;
- batching arithmetic: ``slot_utilization`` and ``simulate_batching`` (static vs continuous
  slot occupancy, the head-of-line blocking example);
- the roofline model (``roofline_step_time``) and knee detection (``find_knee``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path("bench/results")
# Below this throughput gain per doubling of the batch, batching stops paying for its latency.
KNEE_GAIN_PER_DOUBLING = 1.3


# ---- workloads -------------------------------------------------------------------------------
def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0,
                 low_id: int = 10) -> list[list[int]]:
    """``num_prompts`` distinct token-id prompts of exactly ``prompt_len`` tokens.

    Ids are drawn from ``[low_id, vocab_size)`` so special tokens (bos/eos, usually < 10) are
    avoided; distinct random prompts keep the prefix cache from short-cutting prefill.
    """
    if num_prompts <= 0 or prompt_len <= 0:
        raise ValueError(f"num_prompts and prompt_len must be > 0, got {num_prompts}, {prompt_len}")
    low = min(low_id, vocab_size - 1)
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


def heavy_tailed_lengths(num: int, seed: int = 0, low: int = 8, high: int = 512,
                         median: float = 48.0, sigma: float = 1.0) -> list[int]:
    """Seeded lognormal output lengths clipped to ``[low, high]`` (most short, a few long)."""
    if num <= 0 or not 0 < low <= high:
        raise ValueError(f"need num > 0 and 0 < low <= high, got {num}, {low}, {high}")
    rng = random.Random(seed)
    mu = math.log(median)
    return [max(low, min(high, round(rng.lognormvariate(mu, sigma)))) for _ in range(num)]


def poisson_arrivals(num: int, rate_per_s: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from start). ``rate_per_s`` None or <= 0: everyone at t=0."""
    if not rate_per_s or rate_per_s <= 0:
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


# ---- statistics ------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of a latency sample (seconds)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int


def summarize(values: Sequence[float]) -> Stats:
    """Mean and percentiles; an empty sample gives NaNs (e.g. no ITL when every output is 1 token)."""
    if not values:
        nan = float("nan")
        return Stats(nan, nan, nan, nan, 0)
    return Stats(mean=sum(values) / len(values), p50=percentile(values, 50),
                 p90=percentile(values, 90), p99=percentile(values, 99), count=len(values))


# ---- batching arithmetic -----------------------------------------------------------------------
def slot_utilization(useful_token_steps: int, num_slots: int, num_steps: int) -> float:
    """Fraction of batch slots that produced a token: useful / (slots x steps).

    A slot is one of ``max_num_seqs`` places in the running batch; each engine step every slot
    either produces a token for its request (useful) or idles (empty, or waiting for a longer
    batch-mate to finish under static batching).
    """
    if num_slots <= 0 or num_steps < 0 or useful_token_steps < 0:
        raise ValueError(f"need slots > 0, steps >= 0, useful >= 0; got "
                         f"{num_slots}, {num_steps}, {useful_token_steps}")
    if num_steps == 0:
        return 0.0
    if useful_token_steps > num_slots * num_steps:
        raise ValueError(f"{useful_token_steps} useful token-steps cannot fit in "
                         f"{num_slots} slots x {num_steps} steps")
    return useful_token_steps / (num_slots * num_steps)


@dataclass(frozen=True)
class BatchingSimulation:
    """Step count and occupancy of one policy on a list of output lengths (all queued at t=0)."""

    policy: str
    num_slots: int
    num_steps: int
    useful_token_steps: int
    utilization: float


def simulate_batching(output_lens: Sequence[int], num_slots: int,
                      policy: str) -> BatchingSimulation:
    """Idealized step count: every running request makes one token per step.

    ``static`` (and ``dynamic`` with everyone already queued) takes batches of ``num_slots`` in
    arrival order and each batch lasts as long as its longest member. ``continuous`` refills a
    slot the step after it frees, so a queue behind a long request keeps the other slots busy.
    """
    if any(n <= 0 for n in output_lens):
        raise ValueError("output lengths must be > 0")
    if num_slots <= 0:
        raise ValueError(f"num_slots must be > 0, got {num_slots}")
    useful = sum(output_lens)
    if policy in ("static", "dynamic"):
        steps = sum(max(output_lens[i:i + num_slots]) for i in range(0, len(output_lens), num_slots))
    elif policy == "continuous":
        queue = list(output_lens)
        running: list[int] = []  # tokens left per occupied slot
        steps = 0
        while queue or running:
            while queue and len(running) < num_slots:
                running.append(queue.pop(0))
            steps += 1
            running = [r - 1 for r in running if r > 1]
    else:
        raise ValueError(f"unknown policy {policy!r}; choose static, dynamic or continuous")
    return BatchingSimulation(policy, num_slots, steps, useful,
                              slot_utilization(useful, num_slots, steps))


# ---- roofline and knee -----------------------------------------------------------------------
@dataclass(frozen=True)
class RooflinePoint:
    """Predicted decode step time at one batch size and which roof binds it."""

    batch_size: int
    memory_s: float  # weight bytes / bandwidth
    compute_s: float  # 2 * params * batch / matmul rate
    step_s: float  # the larger of the two
    bound: str  # "memory" | "compute"
    throughput_tok_s: float  # batch / step_s


def roofline_step_time(weight_bytes: int, num_params: int, batch_size: int,
                       bandwidth_bytes_s: float, flops_per_s: float) -> RooflinePoint:
    """Predicted step time = max(weights read once per step, 2 x params x batch FLOPs).

    Ignores attention over the KV cache (small for short contexts) and per-step overheads; it
    is the floor a decode step cannot beat, not an estimate of what it will take.
    """
    if batch_size <= 0 or bandwidth_bytes_s <= 0 or flops_per_s <= 0:
        raise ValueError("batch_size, bandwidth and flop rate must be > 0")
    mem = weight_bytes / bandwidth_bytes_s
    comp = 2.0 * num_params * batch_size / flops_per_s
    step = max(mem, comp)
    return RooflinePoint(batch_size, mem, comp, step, "memory" if mem >= comp else "compute",
                         batch_size / step)


def roofline_workload_throughput(weight_bytes: int, num_params: int, embed_params: int,
                                 batch_size: int, prompt_len: int, output_len: int,
                                 bandwidth_bytes_s: float, flops_per_s: float) -> float:
    """Tokens/s a wave of ``batch_size`` requests cannot beat: the prompts' prefill at the
    matmul rate (every non-embedding weight per prompt token, the LM head once per request:
    only the last position is sampled), then ``output_len - 1`` decode steps at
    ``roofline_step_time``. Prefill is compute-bound at every batch size, so it caps how much
    a bigger batch can gain over batch 1 on a workload that includes it."""
    if min(batch_size, prompt_len, output_len) <= 0:
        raise ValueError("batch_size, prompt_len and output_len must be > 0")
    prefill_flops = batch_size * (2.0 * (num_params - embed_params) * prompt_len
                                  + 2.0 * embed_params)
    step = roofline_step_time(weight_bytes, num_params, batch_size, bandwidth_bytes_s,
                              flops_per_s).step_s
    return batch_size * output_len / (prefill_flops / flops_per_s + (output_len - 1) * step)


@dataclass(frozen=True)
class Knee:
    """Where batching stops paying: the last batch size whose next step up still gained enough."""

    batch_size: int
    gains_per_doubling: list[float]  # between consecutive batch sizes


def find_knee(batch_sizes: Sequence[int], throughputs: Sequence[float],
              itls: Sequence[float], min_gain: float = KNEE_GAIN_PER_DOUBLING) -> Knee:
    """The knee: the first batch size after which throughput gains < ``min_gain`` per doubling
    while per-token latency grows. Batch sizes need not be powers of two (the gain between
    ``b1`` and ``b2`` is normalized to ``(t2/t1) ** (1 / log2(b2/b1))``). If every step gains
    enough, the knee is the largest batch size measured.
    """
    if not (len(batch_sizes) == len(throughputs) == len(itls)) or not batch_sizes:
        raise ValueError("batch_sizes, throughputs and itls must be non-empty and equally long")
    if list(batch_sizes) != sorted(set(batch_sizes)):
        raise ValueError("batch_sizes must be strictly increasing")
    gains = []
    for i in range(len(batch_sizes) - 1):
        doublings = math.log2(batch_sizes[i + 1] / batch_sizes[i])
        ratio = throughputs[i + 1] / throughputs[i] if throughputs[i] > 0 else float("inf")
        gains.append(ratio ** (1.0 / doublings) if ratio > 0 else 0.0)
    for i, g in enumerate(gains):
        if g < min_gain and itls[i + 1] > itls[i]:
            return Knee(batch_sizes[i], gains)
    return Knee(batch_sizes[-1], gains)


# ---- machine and output ----------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the figures were measured on (CPU model, cores, torch threads, load average)."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> dicts, NaN/inf -> None (strict JSON), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(out_dir: str | Path, name: str, payload: Any) -> Path:
    """Write ``payload`` as ``<out_dir>/<name>.json`` (creating the folder); returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero (a baseline that did not run)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def target(name: str, measured: float | None, goal: float, higher_is_better: bool = True,
           reason: str = "") -> dict[str, Any]:
    """One line of the targets table: the measured ratio, the goal, and whether it was met."""
    met: bool | None = None
    if measured is not None:
        met = measured >= goal if higher_is_better else measured <= goal
    return {"target": name, "measured": measured, "goal": goal,
            "comparison": ">=" if higher_is_better else "<=", "met": met, "reason": reason}


def print_targets(targets: Sequence[dict[str, Any]]) -> None:
    for t in targets:
        m = "n/a" if t["measured"] is None else f"{t['measured']:.3g}"
        verdict = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[t["met"]]
        extra = f"  ({t['reason']})" if t["reason"] and t["met"] is not True else ""
        print(f"  target {t['target']}: {m} {t['comparison']} {t['goal']:g} -> {verdict}{extra}")


# ---- engine instrumentation ------------------------------------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """One executed engine step as seen by the model runner."""

    num_seqs: int
    num_tokens: int
    is_decode: bool  # every scheduled chunk is a single token
    duration_s: float


class StepRecorder:
    """Times every ``runner.execute`` of an engine (the forward + sampling, no scheduling).

    Installs a timing wrapper on the engine's runner instance; ``close()`` removes it. Steps the
    scheduler found empty never reach the runner, so ``records`` counts working steps only.
    """

    def __init__(self, engine: Any) -> None:
        import time

        self._runner = engine.runner
        self.records: list[StepRecord] = []
        inner = engine.runner.execute

        def timed(sched, *args, **kwargs):
            t0 = time.perf_counter()
            result = inner(sched, *args, **kwargs)
            self.records.append(StepRecord(
                num_seqs=len(sched.chunks), num_tokens=sched.num_batched_tokens,
                is_decode=all(c.num_tokens == 1 for c in sched.chunks),
                duration_s=time.perf_counter() - t0))
            return result

        self._runner.execute = timed

    def reset(self) -> None:
        self.records.clear()

    def close(self) -> None:
        self._runner.__dict__.pop("execute", None)

    def decode_step_times(self, num_seqs: int | None = None) -> list[float]:
        """Durations of pure-decode steps (optionally only those with exactly ``num_seqs``)."""
        return [r.duration_s for r in self.records
                if r.is_decode and (num_seqs is None or r.num_seqs == num_seqs)]


@dataclass(frozen=True)
class ModelSize:
    num_params: int
    weight_bytes: int


def model_size(model: Any) -> ModelSize:
    """Unique parameters and their bytes; tied embeddings count once, as they are read once
    per decode step (as the LM head)."""
    seen: set[int] = set()
    n = b = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
        b += p.numel() * p.element_size()
    return ModelSize(n, b)


def model_config(model: str | None) -> Any:
    """Our engine's ModelConfig for ``model`` (converting the default GGUF on first use)."""
    from engine.weights import load_model_config, resolve_model

    return load_model_config(resolve_model(None if model in (None, "default") else model).model_dir)


def load_llm(model: str | None, **kwargs: Any) -> Any:
    """Build ``engine.LLM`` (``model`` "default" or None -> the default model)."""
    from engine import LLM

    return LLM(model=None if model in (None, "default") else model, **kwargs)
