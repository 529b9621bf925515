"""`pdcluster bench prefix --sweep`: routing policies over a grid of shared-prefix cells.

A cell is a shared-prefix workload: ``P`` system prompts of ``--system-len`` tokens, each used
by exactly ``R`` requests (``P x R`` users; a request is its system prompt + its own
``--question-len``-token question), sent in a seeded shuffled order with at most ``C`` in
flight; every worker's KV pool holds ``pool`` x the cell's working set (every distinct prompt
token), never less than 2 of its longest requests (``bench prefix``'s sizing). The grid is
``--sweep-prefixes`` x ``--sweep-reuse`` x ``--sweep-concurrency`` x ``--sweep-pool``. Every cell
runs every ``--policies`` policy with the host KV tier off and on (``--sweep-tier``), each run on
a fresh 2P + 2D cluster shaped as in ``bench prefix``, every run on one Ray, every run of a cell
on the same requests. Tier on: every worker, prefill and decode, gets
``kv_offload_memory_bytes`` = ``--sweep-tier-size`` (default 2) x the cell's working set.

The cell's floor is each distinct prefix computed once, in whole 16-token blocks (a prefix
cache reuses whole blocks only): every system prompt's full blocks once, plus every request's
remaining tokens (its system prompt's tail past the last full block, and its question).

Checks, per cell and tier (the issue's targets):

- kv_aware's TTFT p50 <= round_robin's x ``TTFT_NOISE`` (no worse, within noise);
- tier on, where a worker's pool + tier hold the working set: kv_aware computes
  <= ``FLOOR_TARGET`` x the floor;
- where round_robin computes >= ``RR_WASTE`` x the floor: round_robin / kv_aware TTFT p50
  >= ``RR_TTFT_TARGET``.

``prefix_sweep.json`` is rewritten after every cell (``"complete": false`` until the last), so
an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from bench.cluster.prefix.runs import (
    POLICIES,
    Shape,
    check_prefill_chunk,
    cluster_config,
    combine,
    names,
    paired_ratio,
    pool_tokens,
    run_on_cluster,
    send_all,
    summary,
    tokens,
    working_set,
)
from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, write_json
from bench.harness.report import target as make_target

NAME = "prefix_sweep"
BLOCK_SIZE = 16  # the sweep's clusters' (bench.cluster.prefix.runs.cluster_config)
TIERS = ("off", "on")
TTFT_NOISE = 1.10  # kv_aware TTFT p50 / round_robin's, at most
FLOOR_TARGET = 1.15  # kv_aware computed / floor, at most (tier on, tiers hold the working set)
RR_WASTE = 1.5  # round_robin computed / floor from which kv_aware must be much faster...
RR_TTFT_TARGET = 2.0  # ...round_robin TTFT p50 / kv_aware's, at least
# Axis flag -> (default, --quick default). The full default: 8 cells x 2 tiers x 3 policies.
AXIS_DEFAULTS = {"prefixes": ("4,12", "4"), "reuse": ("2,4", "2"), "concurrency": ("4", "4"),
                 "pool": ("0.5,1.0", "0.5"), "tier": ("off,on", "off,on")}
LEN_DEFAULTS = {"system_len": (256, 128), "question_len": (16, 16), "output_len": (4, 4)}
TIER_SIZE_DEFAULT = 2.0


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    prefixes: int  # distinct system prompts
    reuse: int  # requests per system prompt
    concurrency: int  # requests in flight
    pool_fraction: float  # each worker's KV pool / the cell's working set

    @property
    def users(self) -> int:
        return self.prefixes * self.reuse

    @property
    def name(self) -> str:
        return f"P{self.prefixes}xR{self.reuse}/C{self.concurrency}/pool{self.pool_fraction:g}"


@dataclass(frozen=True)
class Lengths:
    """Request shape, the same in every cell."""

    system_len: int
    question_len: int
    output_len: int


@dataclass(frozen=True)
class Sizing:
    """A cell's token budgets; pool and tier are per worker (each of the 4 has its own)."""

    working_set_tokens: int
    longest_tokens: int  # system + question + answer
    pool_tokens: int
    tier_tokens: int  # when the tier is on
    floor_tokens: int
    prompt_tokens: int  # every request's whole prompt, for scale

    def tier_holds(self, tier: str) -> bool:
        """Whether, with ``tier``, a worker's pool and host tier together hold the working set
        (where the issue judges computed tokens against the floor)."""
        return tier == "on" and self.pool_tokens + self.tier_tokens >= self.working_set_tokens


@dataclass(frozen=True)
class SweepConfig:
    """Every choice of one sweep, resolved from the flags."""

    cells: tuple[Cell, ...]
    tiers: tuple[str, ...]
    policies: tuple[str, ...]
    lens: Lengths
    tier_size: float  # host tier per worker / the cell's working set
    seed: int
    prefill_chunk: int | None = None  # prefill workers' max_prefill_chunk (--prefill-chunk)
    repeats: int = 1  # runs of every (cell, tier, policy), each on other requests of the cell


@dataclass(frozen=True)
class CellWorkload:
    """A cell's requests in arrival order."""

    prompts: list[list[int]]
    system_ids: list[int]  # the system prompt each request opens with


# ---- flags ---------------------------------------------------------------------------------------
def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--sweep`` flags (``bench prefix`` mounts them); the axes are comma-separated."""
    g = p.add_argument_group(
        "sweep", "--sweep: shared-prefix cells over prefix count x reuse x concurrency x pool "
                 "fraction, host KV tier off/on; each cell runs --policies. Also read: "
                 "--policies, --system-len, --question-len, --output-len, --seed.")
    g.add_argument("--sweep", action="store_true",
                   help="run the grid instead of the two workloads (writes prefix_sweep.json)")
    helps = {"prefixes": "distinct system prompts per cell",
             "reuse": "requests per system prompt",
             "concurrency": "requests in flight",
             "pool": "each worker's KV pool / the cell's working set",
             "tier": "host KV tier, from off,on"}
    for axis, (full, quick) in AXIS_DEFAULTS.items():
        g.add_argument(f"--sweep-{axis}", default=None,
                       help=f"{helps[axis]} (default {full}; --quick {quick})")
    g.add_argument("--sweep-repeats", type=int, default=None,
                   help="runs of every cell, tier and policy, each on other requests of the "
                        "cell's shape; a cell reports each metric's median over them and the "
                        "checks use the median of the per-repeat ratios (default 1)")
    g.add_argument("--sweep-tier-size", type=float, default=None,
                   help="tier on: each worker's host tier / the cell's working set "
                        f"(default {TIER_SIZE_DEFAULT:g})")


def refuse_sweep_flags(args: argparse.Namespace) -> None:
    """A sweep flag without ``--sweep`` would be ignored: refuse it instead."""
    given = [f"--sweep-{a.replace('_', '-')}" for a in (*AXIS_DEFAULTS, "tier_size", "repeats")
             if getattr(args, f"sweep_{a}", None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --sweep")


def parse_axis(text: str, kind: type, flag: str) -> list:
    """'4,12' -> [4, 12] (``kind`` int or float); every value > 0, no repeats."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: not a comma-separated list of {kind.__name__}s: {text!r}"
                         ) from None
    if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{flag}: want distinct values > 0, got {text!r}")
    return values


def expand_grid(prefixes: list[int], reuse: list[int], concurrency: list[int],
                pools: list[float]) -> list[Cell]:
    """Every combination, the last axis varying fastest (a cell's neighbours differ in pool)."""
    return [Cell(*c) for c in itertools.product(prefixes, reuse, concurrency, pools)]


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    """Flags -> a validated ``SweepConfig`` (``--quick`` picks the quick defaults)."""
    pick = 1 if args.quick else 0

    def axis(name: str) -> str:
        given = getattr(args, f"sweep_{name}")
        return AXIS_DEFAULTS[name][pick] if given is None else given

    def length(name: str) -> int:
        given = getattr(args, name)
        return LEN_DEFAULTS[name][pick] if given is None else given

    pools = parse_axis(axis("pool"), float, "--sweep-pool")
    if max(pools) > 4:
        raise ValueError(f"--sweep-pool: at most 4, got {max(pools):g}")
    cells = expand_grid(parse_axis(axis("prefixes"), int, "--sweep-prefixes"),
                        parse_axis(axis("reuse"), int, "--sweep-reuse"),
                        parse_axis(axis("concurrency"), int, "--sweep-concurrency"), pools)
    tiers = names(axis("tier"), TIERS, "--sweep-tier")
    lens = Lengths(length("system_len"), length("question_len"), length("output_len"))
    for name, v in asdict(lens).items():
        # A question of >= 1 token: the floor assumes every request computes its own tail.
        if v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    tier_size = TIER_SIZE_DEFAULT if args.sweep_tier_size is None else args.sweep_tier_size
    if tier_size <= 0:
        raise ValueError(f"--sweep-tier-size must be > 0, got {tier_size:g}")
    check_prefill_chunk(args.prefill_chunk)
    repeats = 1 if args.sweep_repeats is None else args.sweep_repeats
    if repeats < 1:
        raise ValueError(f"--sweep-repeats must be >= 1, got {repeats}")
    return SweepConfig(tuple(cells), tuple(dict.fromkeys(tiers)),
                       tuple(dict.fromkeys(names(args.policies, POLICIES, "--policies"))),
                       lens, tier_size, args.seed, args.prefill_chunk, repeats)


# ---- one cell: sizes, floor, requests ---------------------------------------------------------------
def floor_tokens(prefixes: int, users: int, system_len: int, question_len: int,
                 block_size: int = BLOCK_SIZE) -> int:
    """Prompt tokens computed when each distinct prefix is computed once: every system
    prompt's full blocks once, plus every request's tokens past them."""
    shared = system_len // block_size * block_size
    return prefixes * shared + users * (system_len + question_len - shared)


def cell_sizing(cell: Cell, lens: Lengths, tier_size: float) -> Sizing:
    """The cell's working set, pool and tier per worker, and floor (in tokens)."""
    shape = Shape(conversations=0, turns=0, doc_len=0, user_len=0, output_len=lens.output_len,
                  system_prompts=cell.prefixes, system_len=lens.system_len, users=cell.users,
                  question_len=lens.question_len, concurrency=cell.concurrency,
                  cache_fraction=cell.pool_fraction, think_s=0.0)
    working, longest = working_set("shared_prefix", shape)
    return Sizing(working, longest, pool_tokens(cell.pool_fraction, working, longest),
                  int(tier_size * working),
                  floor_tokens(cell.prefixes, cell.users, lens.system_len, lens.question_len),
                  cell.users * (lens.system_len + lens.question_len))


def cell_workload(cell: Cell, lens: Lengths, vocab: int, seed: int) -> CellWorkload:
    """``P`` system prompts, each opening exactly ``R`` requests, in a seeded shuffled order;
    each request has its own question. The same seed gives the same requests."""
    rng = random.Random(seed)
    systems = [tokens(rng, lens.system_len, vocab) for _ in range(cell.prefixes)]
    order = [p for p in range(cell.prefixes) for _ in range(cell.reuse)]
    rng.shuffle(order)
    prompts = [systems[p] + tokens(rng, lens.question_len, vocab) for p in order]
    return CellWorkload(prompts, order)


# ---- checks ------------------------------------------------------------------------------------
def cell_checks(cell: Cell, sizing: Sizing, tier: str,
                by_policy: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets for one (cell, tier), from its runs' summaries (``measured`` below);
    a policy that did not run (or failed) leaves its checks not measured."""
    kv, rr = by_policy.get("kv_aware", {}), by_policy.get("round_robin", {})
    label = f"{cell.name} tier {tier}"

    def check(name: str, value: float | None, goal: float, higher: bool = True) -> dict:
        # The reason is printed for a check not met, so only say it when nothing was measured.
        reason = "" if value is not None else "kv_aware or round_robin has no result"
        return make_target(f"{label}: {name}", value, goal, higher, reason)

    checks = [check("TTFT p50 kv_aware / round_robin", paired_ratio(kv, rr, "ttft_p50_s"),
                    TTFT_NOISE, higher=False)]
    if sizing.tier_holds(tier):
        checks.append(check("kv_aware computed / floor", kv.get("computed_over_floor"),
                            FLOOR_TARGET, higher=False))
    rr_over = rr.get("computed_over_floor")
    if rr_over is not None and rr_over >= RR_WASTE:
        checks.append(check(f"TTFT p50 round_robin / kv_aware (round_robin computes "
                            f"{rr_over:.2f}x the floor)", paired_ratio(rr, kv, "ttft_p50_s"),
                            RR_TTFT_TARGET))
    return checks


def measured(summary: dict[str, Any], sizing: Sizing) -> dict[str, Any]:
    """A run's summary (``bench prefix``'s) with the cell's floor and computed / floor."""
    return {**summary, "floor_tokens": sizing.floor_tokens,
            "computed_over_floor": summary["computed_prompt_tokens"] / sizing.floor_tokens}


# ---- the run ------------------------------------------------------------------------------------
def _require_tier() -> None:
    from engine import EngineArgs

    if "kv_offload_memory_bytes" not in {f.name for f in fields(EngineArgs)}:
        raise ValueError("--sweep-tier on: this engine has no kv_offload_memory_bytes (the host "
                         "KV tier); run --sweep-tier off")


def _run_one(model: str | None, policy: str, tier: str, cell: Cell, sizing: Sizing,
             work: CellWorkload, lens: Lengths, vocab: int, per_token: int, seed: int,
             prefill_chunk: int | None) -> dict[str, Any]:
    extra = {"kv_offload_memory_bytes": sizing.tier_tokens * per_token} if tier == "on" else None
    config = cluster_config(model, policy, sizing.pool_tokens * per_token,
                             sizing.longest_tokens + BLOCK_SIZE, extra, prefill_chunk)

    def body(cluster: Any, tag: str):
        return send_all(cluster, work.prompts, cell.concurrency, lens.output_len, tag)

    try:
        r = asyncio.run(run_on_cluster(config, "shared_prefix", policy, vocab, seed, body))
    except Exception as e:  # one broken run must not lose a half-hour sweep's other cells
        print(f"    {cell.name} tier {tier} {policy}: FAILED {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}
    return measured(summary(r), sizing)


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Run every cell x tier x policy on one Ray; write ``prefix_sweep.json`` (after every
    cell) and ``prefix_sweep.png``; print one line per run and the checks."""
    cfg = sweep_config(args)
    if "on" in cfg.tiers:
        _require_tier()  # before Ray starts, not half an hour in
    mc = model_config(args.model)
    vocab, per_token = mc.vocab_size, mc.kv_bytes_per_token
    num_runs = len(cfg.cells) * len(cfg.tiers) * len(cfg.policies) * cfg.repeats
    print(f"prefix sweep: {len(cfg.cells)} cells x {len(cfg.tiers)} tiers x "
          f"{len(cfg.policies)} policies x {cfg.repeats} repeats = {num_runs} runs, each on a "
          f"fresh 2P+2D cluster")
    t_start = time.perf_counter()
    cells_out: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    done = 0
    with ray_session(num_workers=4):
        for i, cell in enumerate(cfg.cells):
            sizing = cell_sizing(cell, cfg.lens, cfg.tier_size)
            each: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for r in range(cfg.repeats):  # repeats outermost: the host's drift hits all alike
                # every tier and policy of a cell's repeat: the same requests
                seed = cfg.seed + 1000 * i + 100_003 * r
                work = cell_workload(cell, cfg.lens, vocab, seed)
                for tier in cfg.tiers:
                    for policy in cfg.policies:
                        m = _run_one(args.model, policy, tier, cell, sizing, work, cfg.lens,
                                     vocab, per_token, seed, cfg.prefill_chunk)
                        each.setdefault((tier, policy), []).append(m)
                        done += 1
                        print(f"  [{done}/{num_runs}] {cell.name} tier {tier} {policy}"
                              f"{f' repeat {r + 1}' if cfg.repeats > 1 else ''}: "
                              f"{'failed' if 'error' in m else 'done'} "
                              f"({time.perf_counter() - t_start:.0f} s)")
            runs = {tier: {policy: combine(each[tier, policy]) for policy in cfg.policies}
                    for tier in cfg.tiers}
            for tier in cfg.tiers:
                checks += cell_checks(cell, sizing, tier, runs[tier])
            cells_out.append({"cell": cell.name, **asdict(cell), "users": cell.users,
                              "sizing": {**asdict(sizing), "pool_bytes":
                                         sizing.pool_tokens * per_token, "tier_bytes":
                                         sizing.tier_tokens * per_token}, "runs": runs})
            result = _result(args, cfg, cells_out, checks, t_start,
                             complete=i == len(cfg.cells) - 1)
            path = write_json(Path(args.out), NAME, result)
    _plot(cells_out, Path(args.out) / f"{NAME}.png")
    _print_table(cells_out)
    print_targets(checks)
    print(f"checks: {_tally(checks)}")
    print(f"wrote {path}")
    return result


def _tally(checks: list[dict[str, Any]]) -> dict[str, int]:
    return {"met": sum(c["met"] is True for c in checks),
            "missed": sum(c["met"] is False for c in checks),
            "not_measured": sum(c["met"] is None for c in checks)}


def _result(args: argparse.Namespace, cfg: SweepConfig, cells_out: list[dict[str, Any]],
            checks: list[dict[str, Any]], t_start: float, complete: bool) -> dict[str, Any]:
    return {
        "benchmark": NAME,
        "complete": complete,
        "config": {"model": args.model or "default", **asdict(cfg.lens), "seed": cfg.seed,
                   "policies": list(cfg.policies), "tiers": list(cfg.tiers),
                   "cells": [c.name for c in cfg.cells], "tier_size": cfg.tier_size,
                   "prefill_chunk": cfg.prefill_chunk, "repeats": cfg.repeats,
                   "shape": "2 prefill + 2 decode, block size 16; prefill-i and decode-i "
                            "pinned to core i, 1 torch thread each; a fresh cluster per run",
                   "pool": "per worker: pool fraction x the cell's working set, at least 2 "
                           "longest requests",
                   "tier": "tier on: kv_offload_memory_bytes per worker (prefill and decode) "
                           "= tier_size x the cell's working set",
                   "floor": "each system prompt's full 16-token blocks once + every "
                            "request's tokens past them"},
        "cells": cells_out,
        "checks": checks,
        "checks_tally": _tally(checks),
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(),
    }


def _print_table(cells_out: list[dict[str, Any]]) -> None:
    for c in cells_out:
        floor = c["sizing"]["floor_tokens"]
        for tier, by_policy in c["runs"].items():
            for policy, m in by_policy.items():
                head = f"  {c['cell']:22s} tier {tier:3s} {policy:11s}"
                if "error" in m:
                    print(f"{head} FAILED {m['error']}")
                    continue
                spread = m.get("ttft_p50_s_range")
                if spread:
                    head += f" ({len(m['repeats'])} repeats, TTFT p50 {spread[0] * 1e3:.0f}-" \
                            f"{spread[1] * 1e3:.0f} ms; medians:)"
                print(f"{head} TTFT p50 {m['ttft_p50_s'] * 1e3:6.0f} ms p99 "
                      f"{m['ttft_p99_s'] * 1e3:6.0f} ms  computed "
                      f"{m['computed_prompt_tokens']:6d}/{m['prompt_tokens']} tok "
                      f"{m['computed_over_floor']:5.2f}x floor {floor}  KV moved "
                      f"{m['kv_bytes_moved'] / 1e6:7.1f} MB  hit decode "
                      f"{m['decode_hit_rate']:.0%} prefill {m['prefill_hit_rate']:.0%}  "
                      f"pulled {m.get('pulled_tokens', 0)} restored "
                      f"{m.get('restored_tokens', 0)} tok{_phases(m)}")


def _phases(m: dict[str, Any]) -> str:
    """'  first token: queue 12 + compute 210 + tail 3 + commit 90 ms' (means), or ''."""
    p = m.get("phase_mean_s") or {}
    names = (("prefill_queue", "queue"), ("prefill_compute", "compute"),
             ("kv_transfer_tail", "tail"), ("decode_commit", "commit"))
    if not all(k in p for k, _ in names):
        return ""
    return "  first token: " + " + ".join(f"{short} {p[k] * 1e3:.0f}" for k, short in names) + " ms"


def _plot(cells_out: list[dict[str, Any]], path: Path) -> None:
    """Computed / floor and TTFT p50 per cell, one line per (policy, tier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["cell"] for c in cells_out]
    xs = list(range(len(names)))
    series = sorted({(p, t) for c in cells_out for t, by in c["runs"].items() for p in by})
    colors = {"kv_aware": "#4c72b0", "load": "#dd8452", "round_robin": "#55a868"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.8 * len(names) + 3), 6.5),
                                      sharex=True)
    for policy, tier in series:
        runs = [c["runs"].get(tier, {}).get(policy, {}) for c in cells_out]
        style = dict(color=colors.get(policy), linestyle="-" if tier == "off" else "--",
                     marker="o" if tier == "off" else "s", label=f"{policy}, tier {tier}")
        top.plot(xs, [r.get("computed_over_floor", float("nan")) for r in runs], **style)
        bottom.plot(xs, [r.get("ttft_p50_s", float("nan")) for r in runs], **style)
    top.axhline(FLOOR_TARGET, color="grey", linestyle=":", linewidth=1)
    top.axhline(RR_WASTE, color="grey", linestyle="-.", linewidth=1)
    top.set_ylabel("prompt tokens computed / floor")
    bottom.set_ylabel("TTFT p50 (s)")
    bottom.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
    top.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
