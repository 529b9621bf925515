"""The systems under test of ``pdcluster bench neighbour``: the run's settings, the
prompts, the served systems (``pdcluster serve``, measured over HTTP) and the child
systems (the offline engine and transformers, each in a child process that answers one
JSON line per request)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster.neighbour_loads import (
    Unavailable,
    applied,
    free_port_pair,
    process_name,
    read_pgrp,
    stop_group,
    system_pids,
)
from bench.cluster.neighbour_table import (
    CELL_TIMEOUT_S,
    CHILD_SYSTEMS,
    SERVED,
    Cell,
    parse_threads,
    per_token_s,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
_PROTO = "NBR "  # a child's protocol lines on stdout start with this


@dataclass(frozen=True)
class Settings:
    systems: tuple[str, ...]
    loads: tuple[str, ...]
    batches: tuple[int, ...]
    rounds: int
    input_len: int
    output_len: int
    startup_timeout_s: float
    settle_s: float


# ---- prompts ---------------------------------------------------------------------------------

class Prompts:
    """Fresh seeded token-id prompts for every request of every round."""

    def __init__(self, vocab_size: int, input_len: int, seed: int) -> None:
        self.vocab_size, self.input_len, self.seed = vocab_size, input_len, seed
        self.count = 0

    def batch(self, n: int) -> list[list[int]]:
        from bench.harness.workload import make_prompts

        self.count += 1
        return make_prompts(n, self.input_len, self.vocab_size,
                            seed=self.seed * 1_000_003 + self.count)


# ---- served systems --------------------------------------------------------------------------

def _serve_command() -> list[str]:
    exe = Path(sys.executable).parent / "pdcluster"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "router.cli"]


async def _stream(client: Any, prompt: list[int], output_len: int,
                  model: str | None) -> dict[str, Any]:
    from bench.server.serve_clients import completion_body, completion_events

    times: list[float] = []
    usage = None
    try:
        async for msg in completion_events(client, completion_body(prompt, output_len, model)):
            if msg.get("usage"):
                usage = msg["usage"].get("completion_tokens")
            if msg.get("choices"):
                times.append(time.perf_counter())
    except Exception as e:  # a failed request is a data point
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    tokens_tpot = ((times[-1] - times[0]) / (usage - 1)
                   if usage and usage > 1 and len(times) >= 2 else None)
    return {"tpot_s": per_token_s(times), "chunks": len(times), "tokens": usage,
            "tpot_by_tokens_s": tokens_tpot}


async def _served_cell(base: str, model: str | None, batch: int, rounds: list[list[list[int]]],
                       output_len: int) -> dict[str, Any]:
    import httpx

    from bench.server.serve_engine import engine_steps, scrape

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=batch + 4)) as client:
        before = await scrape(client, f"{base}/metrics", {})
        results = []
        for prompts in rounds:
            results += await asyncio.gather(*[_stream(client, p, output_len, model)
                                              for p in prompts])
        after = await scrape(client, f"{base}/metrics", {})
        try:
            page = await client.get("/metrics")
            threads = parse_threads(page.text) if page.status_code == 200 else None
        except httpx.HTTPError:
            threads = None
    steps = engine_steps(before, after)
    step = steps.by_batch.get(batch) if steps else None
    return {"results": results, "engine_step_s": step["mean_s"] if step else None,
            "engine_steps": step["steps"] if step else 0, "threads": threads}


def _fill_served(cell: Cell, out: dict[str, Any]) -> None:
    res = out["results"]
    tpots = [r["tpot_s"] for r in res if r.get("tpot_s") is not None]
    errors = [r["error"] for r in res if r.get("error")]
    cell.samples = len(tpots)
    cell.ms_per_token = statistics.median(tpots) * 1e3 if tpots else None
    cell.engine_step_ms = out["engine_step_s"] * 1e3 if out["engine_step_s"] else None
    cell.engine_threads = out["threads"]
    by_tokens = [r["tpot_by_tokens_s"] for r in res if r.get("tpot_by_tokens_s") is not None]
    cell.extra.update(
        engine_steps=out["engine_steps"], requests=len(res), failed=len(errors),
        chunks_median=statistics.median([r["chunks"] for r in res if "chunks" in r] or [0]),
        tokens_median=statistics.median([r["tokens"] or 0 for r in res if "tokens" in r] or [0]),
        ms_per_token_by_usage_tokens=statistics.median(by_tokens) * 1e3 if by_tokens else None)
    if errors:
        cell.extra["errors"] = sorted(set(errors))[:3]
    if not tpots:
        cell.error = errors[0] if errors else "no request streamed two chunks"


def _first_model(base: str) -> str | None:
    import httpx

    r = httpx.get(f"{base}/v1/models", timeout=10)
    data = r.json().get("data") or []
    return data[0]["id"] if data else None


def run_served(system: str, s: Settings, args: argparse.Namespace, prompts: Prompts,
               log_dir: Path, info: dict[str, Any]) -> list[Cell]:
    from bench.harness.serve_ab import wait_ready

    port = free_port_pair()
    base = f"http://127.0.0.1:{port}"
    cmd = [*_serve_command(), "serve", "--host", "127.0.0.1", "--http-port", str(port),
           "--grpc-port", str(port + 1), *(["--model", args.model] if args.model else []),
           *SERVED[system]]
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
    log_path = log_dir / f"{system}.log"
    info.update(command=cmd, log=str(log_path))
    cells = [Cell(system, load, b) for load in s.loads for b in s.batches]
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        # process_group=0, not start_new_session: see the module docstring (autogroup).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, process_group=0)
        try:
            wait_ready(port, proc, s.startup_timeout_s)
            info["startup_s"] = time.perf_counter() - t0
            model = _first_model(base)
            info["model"] = model
            pids = system_pids(proc.pid)
            info["processes"] = {str(p): f"{process_name(p)} (pgrp {read_pgrp(p)})" for p in pids}
            print(f"  {system}: up in {info['startup_s']:.0f} s, model {model}, "
                  f"{len(pids)} processes", flush=True)

            def rounds(batch: int, n: int) -> dict[str, Any]:
                return asyncio.run(_served_cell(base, model, batch,
                                                [prompts.batch(batch) for _ in range(n)],
                                                s.output_len))

            _measure_loads(s, cells, lambda: list(system_pids(proc.pid)),
                           warm=lambda b: rounds(b, 1),
                           measure=lambda c: _fill_served(c, rounds(c.batch, s.rounds)))
        except Exception as e:
            _system_failed(system, cells, info, log_path, e)
        finally:
            stop_group(proc)
    return cells


def _measure_loads(s: Settings, cells: Sequence[Cell], pids: Callable[[], list[int]],
                   warm: Callable[[int], object], measure: Callable[[Cell], None]) -> None:
    """What a served and a child system run alike once up: ``warm`` at batch 1, 8 and every
    measured size, then per load, that load applied around ``measure`` of each of its cells
    (a load the host refuses marks its cells unavailable), its facts on every one of them,
    and a progress line per cell."""
    for b in sorted({1, 8, *s.batches}):  # warm-up
        warm(b)
    for load in s.loads:
        mine = [c for c in cells if c.load == load]
        extra: dict[str, Any] = {}
        try:
            with applied(load, pids, s.settle_s, extra):
                for c in mine:
                    measure(c)
        except Unavailable as e:
            for c in mine:
                c.unavailable = str(e)
        for c in mine:
            c.extra.update(extra)
        _progress(mine)


def _system_failed(system: str, cells: Sequence[Cell], info: dict[str, Any], log_path,
                   e: Exception) -> None:
    """A system that broke: its error on every cell it left without a figure, and said."""
    info["error"] = f"{type(e).__name__}: {e}"
    for c in cells:
        if c.ms_per_token is None and not c.unavailable and not c.error:
            c.error = info["error"][:200]
    print(f"  {system}: {info['error']} (log: {log_path})", flush=True)


def _progress(cells: Sequence[Cell]) -> None:
    for c in cells:
        what = (f"{c.ms_per_token:.1f} ms/token" if c.ms_per_token is not None
                else c.unavailable or c.error or "no figure")
        print(f"    {c.system} {c.load} batch {c.batch}: {what}", flush=True)


# ---- child systems (offline engine, transformers) --------------------------------------------

class Child:
    """A child process that loads ``kind``'s model and answers one JSON line per request."""

    def __init__(self, kind: str, model: str | None, log_path: Path) -> None:
        cmd = [sys.executable, "-m", "bench.cluster.neighbour", "--child", kind,
               *(["--model", model] if model else [])]
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, cwd=REPO_ROOT, text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the child within {timeout_s:g} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"the child exited ({self.proc.wait()})")
            if line.startswith(_PROTO):
                msg = json.loads(line[len(_PROTO):])
                if msg.get("error"):
                    raise RuntimeError(msg["error"])
                return msg

    def ask(self, msg: dict[str, Any], timeout_s: float = CELL_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def run_child(system: str, s: Settings, args: argparse.Namespace, prompts: Prompts,
              log_dir: Path, info: dict[str, Any]) -> list[Cell]:
    log_path = log_dir / f"{system}.log"
    info["log"] = str(log_path)
    cells = [Cell(system, load, b) for load in s.loads for b in s.batches]
    t0 = time.perf_counter()
    child = Child(system, args.model, log_path)
    try:
        ready = child.reply(s.startup_timeout_s)
        info.update(startup_s=time.perf_counter() - t0, pid=child.proc.pid,
                    **{k: v for k, v in ready.items() if k != "ready"})
        print(f"  {system}: up in {info['startup_s']:.0f} s (pid {child.proc.pid})", flush=True)

        def rounds(batch: int, n: int) -> dict[str, Any]:
            return child.ask({"cmd": "measure", "batch": batch, "output_len": s.output_len,
                              "rounds": [prompts.batch(batch) for _ in range(n)]})

        def measure(c: Cell) -> None:
            try:
                out = rounds(c.batch, s.rounds)
            except RuntimeError as e:  # the child's own error: this cell only
                c.error = str(e)[:200]
                return
            vals = out["ms"]
            c.samples = len(vals)
            c.ms_per_token = statistics.median(vals) if vals else None
            c.engine_step_ms = c.ms_per_token if system == "offline" else None
            c.engine_threads = out.get("threads")
            c.extra["ms_rounds"] = vals
            if not vals:
                c.error = f"no decode steps at batch {c.batch} were counted"

        _measure_loads(s, cells, lambda: [child.proc.pid], warm=lambda b: rounds(b, 1),
                       measure=measure)
    except Exception as e:
        _system_failed(system, cells, info, log_path, e)
    finally:
        child.close()
    return cells


def _child_offline(model: str | None) -> tuple[Callable[[int, int, list], dict], dict]:
    from bench.harness.engine_under_test import load_llm
    from engine import SamplingParams

    llm = load_llm(model)  # the engine's defaults: threads, adaptive threads, batch cap

    def measure(batch: int, output_len: int, rounds: list) -> dict[str, Any]:
        sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        ms = []
        for prompts in rounds:
            before = {b: (n, t) for b, n, t in llm.engine.stats().decode_steps}
            llm.generate(prompts, sp)
            after = {b: (n, t) for b, n, t in llm.engine.stats().decode_steps}
            n0, t0 = before.get(batch, (0, 0.0))
            n1, t1 = after.get(batch, (0, 0.0))
            if n1 > n0:
                ms.append((t1 - t0) / (n1 - n0) * 1e3)
        return {"ms": ms, "threads": llm.engine.stats().num_threads}

    return measure, {"engine_threads_at_start": llm.engine.stats().num_threads}


def _child_transformers(model: str | None) -> tuple[Callable[[int, int, list], dict], dict]:
    import torch

    from bench.engine.baseline_hf import load_hf_model, pad_id

    torch.set_num_threads(2)
    hf = load_hf_model(model)
    pad = pad_id(hf)

    def generate(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts, dtype=torch.long)  # [B, input_len], all the same length
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        return time.perf_counter() - t0

    def measure(batch: int, output_len: int, rounds: list) -> dict[str, Any]:
        ms = []
        for prompts in rounds:
            one = generate(prompts, 1)
            full = generate(prompts, output_len)
            ms.append((full - one) / (output_len - 1) * 1e3)
        return {"ms": ms, "threads": torch.get_num_threads()}

    return measure, {"torch_threads": torch.get_num_threads()}


def child_main(argv: Sequence[str]) -> int:
    """``python -m bench.cluster.neighbour --child KIND``: load, say ready, then answer one
    ``measure`` request per stdin line until ``quit`` (protocol lines start with ``NBR ``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=CHILD_SYSTEMS, required=True)
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)

    def say(msg: dict[str, Any]) -> None:
        sys.stdout.write(_PROTO + json.dumps(msg) + "\n")
        sys.stdout.flush()

    try:
        load = _child_offline if a.child == "offline" else _child_transformers
        measure, facts = load(a.model)
    except Exception as e:
        say({"error": f"loading: {type(e).__name__}: {e}"})
        return 1
    say({"ready": True, **facts})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            break
        try:
            say(measure(msg["batch"], msg["output_len"], msg["rounds"]))
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}"})
    return 0
