"""`pdcluster profile`: how long this host's engine takes to prefill and to decode, measured.

What a planner needs to predict a cluster (``pdcluster plan``, the autoscaler): the time of a
prefill step by prompt tokens in the step (one prompt, or several batched), the time of a
pure-decode step by batch size and context length (and how fast KV moves between two
processes on this host: ``loopback_bytes_s``, measured beside this by the planner's
``router.planning.loopback``). Measured on an ``LLMEngine`` built from the same ``EngineArgs``
a worker gets (same threads, same kernels), each point the median of a few repetitions of the
engine's own ``step()``, on random prompts (no prefix-cache hit). The result is a JSON file; ``EngineProfile`` reads it back and
interpolates between the points (linearly; beyond the last point, along the last segment).

Quick by default (prompts of 32 to 2048 tokens; about 2 minutes for the default model on one
core); ``full`` adds larger batches and contexts and more repeats. A served profile
(``router.planning.served_profile``) adds what serving does to these steps.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["EngineProfile", "ProfileGrid", "profile_engine"]


@dataclass(frozen=True)
class ProfileGrid:
    """Which points to measure."""

    prompt_lens: tuple[int, ...] = (32, 64, 128, 256, 512)
    prefill_batches: tuple[int, ...] = (1, 4)  # prompts in one prefill step
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (128, 512)
    repeats: int = 3
    decode_steps: int = 5  # decode steps timed per (batch, context)

    @classmethod
    def quick(cls) -> ProfileGrid:
        # Prompts to 2048 tokens: a step's time grows faster than its tokens (attention), so
        # long prompts are measured rather than extrapolated from short ones.
        return cls(prompt_lens=(32, 64, 128, 256, 512, 1024, 2048), prefill_batches=(1, 4),
                   decode_batches=(1, 4, 16), contexts=(128, 512), repeats=3, decode_steps=4)

    def within(self, max_positions: int) -> ProfileGrid:
        """This grid without the prompt lengths and contexts a model of ``max_positions``
        cannot hold (the default grids on a short-context model)."""
        import dataclasses

        room = max_positions - self.decode_steps - 2
        keep = lambda xs: tuple(x for x in xs if x <= room) or (min(xs),)  # noqa: E731
        return dataclasses.replace(self, prompt_lens=keep(self.prompt_lens),
                                   contexts=keep(self.contexts))

    def prefill_points(self, budget: int) -> list[tuple[int, int]]:
        """(prompts, tokens each) to time: several prompts only where they fit one step of a
        worker's ``budget`` (``max_num_batched_tokens``), as a worker would step them."""
        return [(b, n) for n in self.prompt_lens for b in self.prefill_batches
                if b == 1 or b * n <= budget]

    @classmethod
    def full(cls) -> ProfileGrid:
        return cls(prompt_lens=(32, 64, 128, 256, 512, 1024, 2048), prefill_batches=(1, 2, 4, 8),
                   decode_batches=(1, 2, 4, 8, 16, 32, 64), contexts=(128, 512, 1024),
                   repeats=5, decode_steps=8)


@dataclass
class EngineProfile:
    """Measured step times of one engine configuration on one host (JSON: ``to_json``)."""

    model_id: str
    num_threads: int | None
    device: str
    max_num_batched_tokens: int
    kv_bytes_per_token: int  # as the profiled pool stores a token (--kv-cache-dtype)
    # (prompts in the step, tokens of each, seconds) and (batch, context, seconds)
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    loopback_bytes_s: float = 0.0  # KV between two processes of this host (router.planning.loopback)
    host: dict = field(default_factory=dict)
    wall_s: float = 0.0
    # Measured while serving (router.planning.served_profile): the steps as a cluster's
    # workers take them, and the first token's fixed cost beyond the prefill's compute
    # (router calls, Ray hops, the exposed KV tail). None: a bare engine's profile.
    served: bool = False
    overhead_s: float | None = None
    # The router process's CPU seconds per token it streams (served profiles): on a host
    # where the workers share cores with the router, what streaming takes from them.
    router_cpu_s_per_token: float = 0.0
    # How serving steps slow each other (served profiles; 1 and 0 for a bare engine, whose
    # steps were measured alone): a prefill step's time while the decode worker steps, over
    # its time alone; a decode step's while a prefill computes, over its time alone; and the
    # first token's wait on a busy decode worker (its reserve and commit are answered between
    # steps), in that worker's decode steps.
    prefill_beside_decode: float = 1.0
    decode_beside_prefill: float = 1.0
    busy_overhead_steps: float = 0.0

    # ---- reading it ------------------------------------------------------------------------
    def prefill_s(self, tokens: int) -> float:
        """Seconds of one prefill step computing ``tokens`` prompt tokens, as one prompt's
        (the one-prompt points; a profile without them folds its batches in by tokens). A
        step of several shorter prompts costs a little less (less attention): an upper
        bound there."""
        ones = [pt for pt in self.prefill if pt[0] == 1]
        by_tokens: dict[int, list[float]] = {}
        for b, n, s in ones or self.prefill:
            by_tokens.setdefault(b * n, []).append(s)
        pts = sorted((t, statistics.median(v)) for t, v in by_tokens.items())
        return _interp(pts, tokens)

    def decode_step_s(self, batch: int, context: int) -> float:
        """Seconds of one pure-decode step of ``batch`` sequences of ``context`` tokens each
        (interpolated in batch at the two nearest measured contexts, then in context)."""
        contexts = sorted({c for _, c, _ in self.decode})
        if not contexts:
            raise ValueError("the profile has no decode points")
        lo = max([c for c in contexts if c <= context], default=contexts[0])
        hi = min([c for c in contexts if c >= context], default=contexts[-1])
        at = {c: _interp(sorted((b, s) for b, cc, s in self.decode if cc == c), batch)
              for c in {lo, hi}}
        return _interp(sorted(at.items()), context) if lo != hi else at[lo]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> EngineProfile:
        d = json.loads(text)
        d["prefill"] = [tuple(r) for r in d["prefill"]]
        d["decode"] = [tuple(r) for r in d["decode"]]
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        return cls.from_json(Path(path).read_text())


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x); beyond either end, along the end
    segment (never below 0)."""
    if not points:
        raise ValueError("no points to interpolate")
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1 or (x1, y1) == points[-1]:
            if x < x0 and (x0, y0) != points[0]:
                continue
            return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    raise AssertionError("unreachable")


# ---- measuring -------------------------------------------------------------------------------
def profile_engine(args, grid: ProfileGrid | None = None, seed: int = 0,
                   progress=lambda msg: None) -> EngineProfile:
    """Measure ``grid`` (default: the quick one; lengths the model's context cannot hold are
    left out) on an engine
    built from ``args`` (``EngineArgs``; prefix caching is turned off, and the token budget
    raised to fit the largest point; the profile keeps ``args``' budget, a worker's). The
    loopback bandwidth is left at 0 (``router.planning.loopback.add_loopback`` measures it)."""
    import dataclasses

    from engine.contract import SamplingParams
    from engine.runtime.llm_engine import LLMEngine
    from engine.weights.resolve import load_model_config, resolve_model

    resolved = resolve_model(args.model)
    grid = (grid or ProfileGrid.quick()).within(load_model_config(
        resolved.model_dir, model_id=resolved.model_id).max_position_embeddings)
    t0 = time.perf_counter()
    budget = args.max_num_batched_tokens
    points = grid.prefill_points(budget)
    widest = max(max(b * n for b, n in points), max(grid.decode_batches) * max(grid.contexts))
    longest = max(*grid.prompt_lens, *grid.contexts, 32) + grid.decode_steps + 8  # 32: warm-up
    args = dataclasses.replace(
        args, enable_prefix_caching=False, max_num_seqs=max(max(grid.decode_batches),
                                                            max(grid.prefill_batches)),
        max_num_batched_tokens=max(args.max_num_batched_tokens, widest),
        max_model_len=max(args.max_model_len or 0, longest))
    engine = LLMEngine(args)
    try:
        cfg = engine.model_config
        if max(grid.prompt_lens + grid.contexts) + grid.decode_steps + 2 > cfg.max_position_embeddings:
            raise ValueError(f"the grid's longest prompt does not fit the model's context "
                             f"({cfg.max_position_embeddings})")
        rng = random.Random(seed)
        vocab = cfg.vocab_size

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        ids = iter(range(10**9))
        # The first steps pay one-time costs (allocations, kernel plans): not measured.
        engine.add_request(prompt(32), one, f"warm-{next(ids)}")
        while engine.has_unfinished_requests:
            engine.step()
        # KV bytes a token as this engine's pool stores them (--kv-cache-dtype): what the
        # planner sizes pools and transfers by
        prof = EngineProfile(cfg.model_id, args.num_threads, str(engine.device), budget,
                             cfg.kv_cache_bytes_per_token(args.kv_cache_dtype))
        for b, n in points:
            times = []
            for _ in range(grid.repeats):
                for _ in range(b):
                    engine.add_request(prompt(n), one, f"p-{next(ids)}")
                start = time.perf_counter()
                while engine.has_unfinished_requests:
                    engine.step()
                times.append(time.perf_counter() - start)
            prof.prefill.append((b, n, statistics.median(times)))
            progress(f"prefill {b} x {n} tokens: {statistics.median(times) * 1e3:.1f} ms")
        for c in grid.contexts:
            for b in grid.decode_batches:
                params = SamplingParams(max_tokens=grid.decode_steps + 2, temperature=0,
                                        ignore_eos=True)
                rids = [f"d-{next(ids)}" for _ in range(b)]
                for rid in rids:
                    engine.add_request(prompt(c), params, rid)
                # Prefill them all (first token each), then time pure-decode steps.
                started: set[str] = set()
                while not started.issuperset(rids):
                    started |= {o.request_id for o in engine.step() if o.token_ids}
                times = []
                for _ in range(grid.decode_steps):
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
                while engine.has_unfinished_requests:
                    engine.step()
                prof.decode.append((b, c, statistics.median(times)))
                progress(f"decode batch {b} at {c} tokens: {statistics.median(times) * 1e3:.1f} ms")
    finally:
        engine.close()
    prof.wall_s = time.perf_counter() - t0
    return prof

