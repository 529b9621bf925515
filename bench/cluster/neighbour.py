"""`pdcluster bench neighbour`: time per output token beside a busy neighbour, in one run.

    pdcluster bench neighbour [--systems offline,colocated,colocated-t2,disaggregated,
                               transformers] [--loads quiet,nice19,nice0,quota1]
                              [--batches 1,8] [--rounds 2] [--input-len 64] [--output-len 64]

Systems: ``offline`` (``engine.LLM()`` with its default arguments, in a child process);
``colocated`` (``pdcluster serve --mode colocated``), ``colocated-t2`` (the same with
``--threads-per-worker 2``) and ``disaggregated`` (``pdcluster serve``), each started once on
free 127.0.0.1 ports; ``transformers`` (``generate`` on the same weights,
``bench.engine.baseline_hf.load_hf_model``, ``torch.set_num_threads(2)``, in a child process).

Loads, one after another on the same running system: ``quiet``; ``nice19`` and ``nice0`` (one
``python -c "while True: pass"`` started by this benchmark at that niceness, ended by its pid);
``quota1`` (the system's processes moved into a new cgroup with a CPU quota of one core:
cgroup v2 ``cpu.max`` = ``100000 100000``, or v1 ``cpu.cfs_quota_us`` = ``cpu.cfs_period_us``
= 100000; moved back and the cgroup removed afterwards; where the host does not let us create
it, the cell says ``unavailable`` and why). After a load is applied the benchmark waits
``--settle-s`` (so the engine's thread governor, ``engine.cpu_threads``, sees it), then measures
every batch size.

Per cell (system, load, batch B), on ``--input-len``-token prompts that are new for every
request and round (the prefix cache cannot help), ``--output-len`` tokens each, greedy,
``ignore_eos``:

- served: B concurrent streamed ``/v1/completions`` requests per round; a request's time per
  output token is (last SSE data chunk - first) / (chunks - 1), and the cell is the median over
  the requests of ``--rounds`` rounds. Beside it, the engines' own pure-decode step at batch B
  (the delta of ``pdcluster_engine_decode_step_seconds_total`` over
  ``pdcluster_engine_decode_steps_total`` with ``batch="B"`` on ``/metrics`` across the cell)
  and ``pdcluster_engine_threads`` after the cell, when the server exports it;
- offline: the engine's mean decode step at batch B from its own counters
  (``LLMEngine.stats().decode_steps``) per round, median over rounds;
- transformers: (time of a ``generate`` of ``--output-len`` tokens - time of a 1-token
  ``generate`` of the same prompts) / (output-len - 1) per round, median over rounds.

Reported per system and batch: the quiet ms/token and, per load, ms/token and its ratio to
quiet, against the targets: nice0 <= 2.0x quiet offline and <= 2.5x quiet served (colocated,
colocated-t2, disaggregated); nice19 <= 1.3x (offline and served). transformers and quota1 are
reported without a target. Every cell is printed, the missed ones included, and written to
``<out>/neighbour.json``.

Process groups, not sessions: a server is started with ``process_group=0`` (its own process
group, in this benchmark's session), not ``start_new_session``. With Linux's autogroup
(``/proc/sys/kernel/sched_autogroup_enabled``) each session is its own scheduling group that
gets a fair share of the CPU as a whole, so a server in a new session would get its share
whatever the neighbour's niceness, and nice 19 vs nice 0 would not be measured. Ray's daemons
inherit the server's group; Ray's workers put themselves in process groups of their own but
stay in the session. So the system's processes (``system_pids``: the group's members from
``/proc/*/stat`` field ``pgrp``, and all their descendants) are what the cgroup move takes,
and the server is ended with ``os.killpg`` (SIGTERM, then SIGKILL after a timeout), with any
of its processes still there afterwards killed by pid (checked against its start time).
Nothing is killed by name.

Niceness: Ray starts its worker processes at nice 15 by default (``worker_niceness``), where a
nice-0 neighbour takes almost all of a shared core from them; pdcluster starts Ray with
``worker_niceness`` 0 (``router.cluster.local_ray``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import machine_info, write_json
from bench.report import target as make_target

NAME = "neighbour"
HELP = ("time per output token beside a busy neighbour (nice 19, nice 0, a 1-core quota): "
        "offline engine, served, transformers")

SYSTEMS = ("offline", "colocated", "colocated-t2", "disaggregated", "transformers")
SERVED = {"colocated": ["--mode", "colocated"],
          "colocated-t2": ["--mode", "colocated", "--threads-per-worker", "2"],
          "disaggregated": []}
CHILD_SYSTEMS = ("offline", "transformers")
LOADS = ("quiet", "nice19", "nice0", "quota1")
NICE = {"nice19": 19, "nice0": 0}
BUSY_LOOP = "while True: pass"
QUOTA_PERIOD_US = 100_000
CELL_TIMEOUT_S = 900.0  # one cell of a child system (all its rounds)
REPO_ROOT = Path(__file__).resolve().parents[2]
_PROTO = "NBR "  # a child's protocol lines on stdout start with this


def goal_for(system: str, load: str) -> float | None:
    """The most a load may slow ``system`` (ratio to quiet), or None: no target."""
    if system == "transformers":
        return None
    if load == "nice0":
        return 2.0 if system == "offline" else 2.5
    if load == "nice19":
        return 1.3
    return None


# ---- arguments -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"comma list of {', '.join(LOADS)} (default: all; ratios are to quiet)")
    p.add_argument("--batches", default=None,
                   help="comma list of batch sizes (default 1,8; --quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per cell (default 2; --quick 1)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens per request (default 64; --quick 16)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0,
                   help="wait at most this long for a server's /health (or a child's model) "
                        "(default 300)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="seconds between applying a load and measuring (default 1)")


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


def _names(text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise ValueError(f"{flag}: a comma list of {', '.join(allowed)}; got {text!r}")
    return names


def settings(args: argparse.Namespace) -> Settings:
    """The run's sizes from the flags (``--quick``: rounds 1, output-len 16, batches 1, unless
    given explicitly). Raises ValueError on a bad flag."""
    quick = getattr(args, "quick", False)
    batches_text = args.batches or ("1" if quick else "1,8")
    try:
        batches = tuple(dict.fromkeys(int(b) for b in batches_text.split(",") if b.strip()))
    except ValueError:
        raise ValueError(f"--batches: a comma list of integers, got {batches_text!r}") from None
    s = Settings(systems=_names(args.systems, SYSTEMS, "--systems"),
                 loads=_names(args.loads, LOADS, "--loads"), batches=batches,
                 rounds=args.rounds or (1 if quick else 2), input_len=args.input_len,
                 output_len=args.output_len or (16 if quick else 64),
                 startup_timeout_s=args.startup_timeout_s, settle_s=args.settle_s)
    if not s.batches or min(s.batches) <= 0:
        raise ValueError("--batches: sizes must be > 0")
    if s.rounds <= 0 or s.input_len <= 0:
        raise ValueError("--rounds and --input-len must be > 0")
    if s.output_len < 2:
        raise ValueError("--output-len must be >= 2 (time per token needs two tokens)")
    if s.startup_timeout_s <= 0 or s.settle_s < 0:
        raise ValueError("--startup-timeout-s must be > 0 and --settle-s >= 0")
    return s


# ---- cells, verdicts, the table (pure) -------------------------------------------------------

@dataclass
class Cell:
    """One (system, load, batch) measurement; ``ms_per_token`` None when it has none."""

    system: str
    load: str
    batch: int
    ms_per_token: float | None = None
    samples: int = 0  # requests (served) or rounds (offline, transformers) behind the median
    engine_step_ms: float | None = None  # the engine's own pure-decode step at this batch
    engine_threads: Any = None  # int (offline) or {worker: threads} (served)
    unavailable: str | None = None  # the load could not be applied, and why
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def verdict(load: str, ratio: float | None, goal: float | None, ms: float | None,
            unavailable: str | None = None, error: str | None = None) -> str:
    """``met`` / ``MISSED`` against ``goal``, or why there is no verdict."""
    if unavailable:
        return f"unavailable: {unavailable}"
    if error:
        return f"error: {error}"
    if ms is None:
        return "not measured"
    if load == "quiet":
        return "baseline"
    if goal is None:
        return "no target"
    if ratio is None:
        return "no quiet baseline"
    return "met" if ratio <= goal else "MISSED"


def rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Every cell with its quiet figure (same system and batch), ratio, goal and verdict."""
    quiet = {(c.system, c.batch): c.ms_per_token for c in cells if c.load == "quiet"}
    out = []
    for c in cells:
        q = quiet.get((c.system, c.batch))
        ratio = c.ms_per_token / q if c.ms_per_token is not None and q else None
        goal = goal_for(c.system, c.load)
        v = verdict(c.load, ratio, goal, c.ms_per_token, c.unavailable, c.error)
        out.append({"system": c.system, "load": c.load, "batch": c.batch,
                    "ms_per_token": c.ms_per_token, "quiet_ms_per_token": q,
                    "ratio_to_quiet": ratio, "goal": goal,
                    "met": {"met": True, "MISSED": False}.get(v), "verdict": v,
                    "samples": c.samples, "engine_step_ms": c.engine_step_ms,
                    "engine_threads": c.engine_threads, "unavailable": c.unavailable,
                    "error": c.error, **c.extra})
    return out


def targets(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """bench.report's targets lines for every cell that has a goal."""
    return [make_target(f"{r['system']} batch {r['batch']} {r['load']} / quiet ms per token",
                        r["ratio_to_quiet"], r["goal"], higher_is_better=False,
                        reason="" if r["verdict"] in ("met", "MISSED") else r["verdict"])
            for r in table if r["goal"] is not None]


def _fmt_threads(t: Any) -> str:
    if t is None:
        return "-"
    if isinstance(t, dict):
        return ",".join(f"{v:g}" for _, v in sorted(t.items())) or "-"
    return f"{t:g}" if isinstance(t, int | float) else str(t)


def render_table(table: Sequence[dict[str, Any]]) -> str:
    """The table the benchmark prints: one line per cell, every cell shown."""
    head = ("system", "batch", "load", "ms/token", "quiet ms", "x quiet", "goal", "engine ms",
            "threads", "verdict")
    lines = [head]
    for r in table:
        ms, q, ratio = r["ms_per_token"], r["quiet_ms_per_token"], r["ratio_to_quiet"]
        lines.append((r["system"], str(r["batch"]), r["load"],
                      "-" if ms is None else f"{ms:.1f}", "-" if q is None else f"{q:.1f}",
                      "-" if ratio is None else f"{ratio:.2f}x",
                      "-" if r["goal"] is None else f"<={r['goal']:.1f}x",
                      "-" if r["engine_step_ms"] is None else f"{r['engine_step_ms']:.1f}",
                      _fmt_threads(r["engine_threads"]), r["verdict"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    right = {1, 3, 4, 5, 7}
    out = []
    for line in lines:
        cols = [(s.rjust(w) if i in right else s.ljust(w))
                for i, (s, w) in enumerate(zip(line[:-1], widths, strict=True))]
        out.append("  ".join([*cols, line[-1]]).rstrip())
    return "\n".join(out)


# ---- helpers: SSE timing, metrics, process groups --------------------------------------------

def per_token_s(chunk_times: Sequence[float]) -> float | None:
    """A stream's time per output token: (last data chunk - first) / (chunks - 1); None
    with fewer than two chunks."""
    if len(chunk_times) < 2:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (len(chunk_times) - 1)


_THREADS = re.compile(r"^pdcluster_engine_threads(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_threads(text: str) -> dict[str, float] | None:
    """``pdcluster_engine_threads`` per worker (its ``worker`` label, else all its labels)
    from a Prometheus text page; None when the page has no such gauge."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _THREADS.match(line.strip())
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1) or ""))
        key = labels.get("worker") or ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        try:
            out[key] = float(m.group(2))
        except ValueError:
            continue
    return out or None


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` used here."""

    ppid: int
    pgrp: int
    starttime: int | None  # clock ticks after boot: tells a pid's reuse apart


def read_stat(pid: int, proc: str | Path = "/proc") -> ProcStat | None:
    """``pid``'s parent, process group (field 5) and start time; None when it is gone."""
    try:
        text = (Path(proc) / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ')'.
    rest = text[text.rfind(")") + 1:].split()  # from field 3: state, ppid, pgrp, ...
    try:
        ppid, pgrp = int(rest[1]), int(rest[2])
    except (IndexError, ValueError):
        return None
    start = int(rest[19]) if len(rest) > 19 and rest[19].isdigit() else None
    return ProcStat(ppid, pgrp, start)


def read_pgrp(pid: int, proc: str | Path = "/proc") -> int | None:
    """The process group of ``pid``, None when it is gone."""
    st = read_stat(pid, proc)
    return st.pgrp if st else None


def _all_stats(proc: str | Path) -> dict[int, ProcStat]:
    try:
        entries = os.listdir(proc)
    except OSError:
        return {}
    stats = {int(e): read_stat(int(e), proc) for e in entries if e.isdigit()}
    return {pid: st for pid, st in stats.items() if st is not None}


def pgroup_pids(pgid: int, proc: str | Path = "/proc") -> list[int]:
    """Every live pid whose process group is ``pgid``."""
    return sorted(pid for pid, st in _all_stats(proc).items() if st.pgrp == pgid)


def system_pids(pgid: int, proc: str | Path = "/proc") -> dict[int, int | None]:
    """The processes of a system started as process group ``pgid``: the group's members and
    every descendant of theirs, pid -> start time. Descendants count because Ray's workers
    put themselves in process groups of their own (same session); a cgroup move of the
    group alone would leave the engines out."""
    stats = _all_stats(proc)
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(st.ppid, []).append(pid)
    todo = [pid for pid, st in stats.items() if st.pgrp == pgid]
    found: dict[int, int | None] = {}
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = stats[pid].starttime
        todo += children.get(pid, [])
    return dict(sorted(found.items()))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def free_port_pair() -> int:
    """A port P on 127.0.0.1 with P + 1 free too (bound to port 0, then checked)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


# ---- loads -----------------------------------------------------------------------------------

class Unavailable(Exception):
    """A load this host does not let us apply (the reason is the message)."""


@contextlib.contextmanager
def neighbour(nice: int) -> Iterator[subprocess.Popen]:
    """One busy Python loop at ``nice``, started here and ended by its pid."""
    try:
        proc = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", BUSY_LOOP],
                                stdin=subprocess.DEVNULL)
    except OSError as e:
        raise Unavailable(f"cannot start the neighbour: {e}") from None
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _proc_cgroup(pid: int, v2: bool) -> str | None:
    """``pid``'s cgroup path: the ``0::`` line on v2, the cpu controller's on v1."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return cgroup_path(text, v2)


def cgroup_path(proc_cgroup_text: str, v2: bool) -> str | None:
    """The path in a ``/proc/<pid>/cgroup`` text: v2's ``0::`` line, or v1's cpu line."""
    for line in proc_cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if v2 and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if not v2 and "cpu" in parts[1].split(","):
            return parts[2]
    return None


class QuotaCgroup:
    """A new cgroup with a CPU quota of ``cpus`` cores; ``add`` moves processes into it,
    ``remove`` moves them back to where they were (else the parent) and removes it."""

    def __init__(self, cpus: float = 1.0, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.cpus = cpus
        self.root = root
        self.v2 = (root / "cgroup.controllers").exists()
        self.mount = root if self.v2 else root / "cpu"
        self.path = self.mount / f"pdcluster-neighbour-{os.getpid()}"
        self.origin: dict[int, str | None] = {}
        self.enabled_cpu = False
        self.created = False

    def create(self) -> None:
        quota = int(round(self.cpus * QUOTA_PERIOD_US))
        try:
            if self.v2:
                controllers = (self.root / "cgroup.controllers").read_text().split()
                if "cpu" not in controllers:
                    raise Unavailable("cgroup v2 without the cpu controller")
                subtree = self.root / "cgroup.subtree_control"
                if "cpu" not in subtree.read_text().split():
                    subtree.write_text("+cpu")
                    self.enabled_cpu = True
                self.path.mkdir()
                self.created = True
                (self.path / "cpu.max").write_text(f"{quota} {QUOTA_PERIOD_US}")
            else:
                if not (self.mount / "cpu.cfs_quota_us").exists():
                    raise Unavailable(f"no cgroup v2 at {self.root} and no cgroup v1 cpu "
                                      f"controller at {self.mount}")
                self.path.mkdir()
                self.created = True
                (self.path / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as e:
            self.remove()
            raise Unavailable(f"cannot create a cgroup with a CPU quota ({e})") from None

    def add(self, pids: Sequence[int]) -> int:
        """Move ``pids`` in (a pid that is gone is skipped); how many moved."""
        moved = 0
        for pid in pids:
            origin = _proc_cgroup(pid, self.v2)
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                continue
            except OSError as e:
                if e.errno == errno.ESRCH:
                    continue
                raise Unavailable(f"cannot move pid {pid} into {self.path} ({e})") from None
            self.origin[pid] = origin
            moved += 1
        if not moved:
            raise Unavailable("no process of the system could be moved into the cgroup")
        return moved

    def stat(self) -> dict[str, int]:
        """The cgroup's ``cpu.stat`` (throttled periods and time)."""
        try:
            text = (self.path / "cpu.stat").read_text()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def remove(self) -> str | None:
        """Everything back out, the cgroup removed; a warning when something was left."""
        parent = self.path.parent
        if self.created:
            try:
                left = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                left = []
            for pid in dict.fromkeys([*self.origin, *left]):
                origin = self.origin.get(pid)
                dests = ([self.mount / origin.lstrip("/")] if origin else []) + [parent]
                for dest in dests:
                    try:
                        (dest / "cgroup.procs").write_text(str(pid))
                        break
                    except OSError:
                        continue
            for _ in range(50):
                try:
                    self.path.rmdir()
                    self.created = False
                    break
                except FileNotFoundError:
                    self.created = False
                    break
                except OSError:
                    time.sleep(0.1)
        if self.enabled_cpu:
            with contextlib.suppress(OSError):
                (self.root / "cgroup.subtree_control").write_text("-cpu")
            self.enabled_cpu = False
        return f"cgroup {self.path} could not be removed" if self.created else None


@contextlib.contextmanager
def applied(load: str, pids: Callable[[], list[int]], settle_s: float,
            extra: dict[str, Any]) -> Iterator[None]:
    """``load`` in force for the body (after ``settle_s``); raises Unavailable when it cannot
    be applied. Quota facts (pids moved, throttling) go into ``extra``."""
    if load == "quiet":
        time.sleep(settle_s)
        yield
    elif load in NICE:
        with neighbour(NICE[load]) as proc:
            extra["neighbour_pid"] = proc.pid
            time.sleep(settle_s)
            yield
    elif load == "quota1":
        cg = QuotaCgroup(1.0)
        cg.create()
        try:
            extra["quota_cgroup"] = str(cg.path)
            extra["quota_pids_moved"] = cg.add(pids())
            time.sleep(settle_s)
            before = cg.stat()
            yield
            after = cg.stat()
            extra["quota_cpu_stat"] = {k: v - before.get(k, 0) for k, v in after.items()}
        finally:
            warning = cg.remove()
            if warning:
                extra["quota_warning"] = warning
    else:
        raise ValueError(f"unknown load {load!r}")


# ---- prompts ---------------------------------------------------------------------------------

class Prompts:
    """Fresh seeded token-id prompts for every request of every round."""

    def __init__(self, vocab_size: int, input_len: int, seed: int) -> None:
        self.vocab_size, self.input_len, self.seed = vocab_size, input_len, seed
        self.count = 0

    def batch(self, n: int) -> list[list[int]]:
        from bench.workload import make_prompts

        self.count += 1
        return make_prompts(n, self.input_len, self.vocab_size,
                            seed=self.seed * 1_000_003 + self.count)


# ---- served systems --------------------------------------------------------------------------

def _serve_command() -> list[str]:
    exe = Path(sys.executable).parent / "pdcluster"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "router.cli"]


def stop_group(proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """End a server started with ``process_group=0``: SIGTERM to its group, then SIGKILL to
    its group and to any of its descendants (``system_pids``, taken before the SIGTERM; each
    by pid, checked against its start time) still there after ``timeout_s``."""
    pgid = proc.pid
    before = system_pids(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)

    def left() -> list[int]:
        return [pid for pid, start in before.items() if pid != pgid
                and (st := read_stat(pid)) is not None and st.starttime == start]

    deadline = time.monotonic() + 10.0
    while proc.poll() is not None and left() and time.monotonic() < deadline:
        time.sleep(0.5)  # the server is gone; Ray's processes end on their own shortly
    if proc.poll() is None or pgroup_pids(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    for pid in left():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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
    from bench.server.serve_ab import wait_ready

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
            info["processes"] = {str(p): f"{_comm(p)} (pgrp {read_pgrp(p)})" for p in pids}
            print(f"  {system}: up in {info['startup_s']:.0f} s, model {model}, "
                  f"{len(pids)} processes", flush=True)
            for b in sorted({1, 8, *s.batches}):  # warm-up
                asyncio.run(_served_cell(base, model, b, [prompts.batch(b)], s.output_len))
            for load in s.loads:
                mine = [c for c in cells if c.load == load]
                extra: dict[str, Any] = {}
                try:
                    with applied(load, lambda: list(system_pids(proc.pid)), s.settle_s,
                                 extra):
                        for c in mine:
                            out = asyncio.run(_served_cell(
                                base, model, c.batch,
                                [prompts.batch(c.batch) for _ in range(s.rounds)],
                                s.output_len))
                            _fill_served(c, out)
                except Unavailable as e:
                    for c in mine:
                        c.unavailable = str(e)
                for c in mine:
                    c.extra.update(extra)
                _progress(mine)
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
            for c in cells:
                if c.ms_per_token is None and not c.unavailable and not c.error:
                    c.error = info["error"][:200]
            print(f"  {system}: {info['error']} (log: {log_path})", flush=True)
        finally:
            stop_group(proc)
    return cells


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
        for b in sorted({1, 8, *s.batches}):  # warm-up
            child.ask({"cmd": "measure", "batch": b, "output_len": s.output_len,
                       "rounds": [prompts.batch(b)]})
        for load in s.loads:
            mine = [c for c in cells if c.load == load]
            extra: dict[str, Any] = {}
            try:
                with applied(load, lambda: [child.proc.pid], s.settle_s, extra):
                    for c in mine:
                        try:
                            out = child.ask({"cmd": "measure", "batch": c.batch,
                                             "output_len": s.output_len,
                                             "rounds": [prompts.batch(c.batch)
                                                        for _ in range(s.rounds)]})
                        except RuntimeError as e:  # the child's own error: this cell only
                            c.error = str(e)[:200]
                            continue
                        vals = out["ms"]
                        c.samples = len(vals)
                        c.ms_per_token = statistics.median(vals) if vals else None
                        c.engine_step_ms = c.ms_per_token if system == "offline" else None
                        c.engine_threads = out.get("threads")
                        c.extra["ms_rounds"] = vals
                        if not vals:
                            c.error = f"no decode steps at batch {c.batch} were counted"
            except Unavailable as e:
                for c in mine:
                    c.unavailable = str(e)
            for c in mine:
                c.extra.update(extra)
            _progress(mine)
    except Exception as e:
        info["error"] = f"{type(e).__name__}: {e}"
        for c in cells:
            if c.ms_per_token is None and not c.unavailable and not c.error:
                c.error = info["error"][:200]
        print(f"  {system}: {info['error']} (log: {log_path})", flush=True)
    finally:
        child.close()
    return cells


def _child_offline(model: str | None) -> tuple[Callable[[int, int, list], dict], dict]:
    from bench.harness import load_llm
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


def _child_main(argv: Sequence[str]) -> int:
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


# ---- the benchmark ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.harness import model_config

    s = settings(args)
    # A SIGTERM (a timeout, an operator) unwinds like Ctrl-C, so every finally below ends the
    # neighbours, quotas and servers this run started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.perf_counter()
    out = Path(args.out)
    log_dir = out / "neighbour_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(model_config(args.model).vocab_size, s.input_len, args.seed)
    print(f"neighbour: systems {','.join(s.systems)}; loads {','.join(s.loads)}; batches "
          f"{','.join(map(str, s.batches))}; {s.rounds} round(s) of {s.input_len}-token "
          f"prompts, {s.output_len} tokens each", flush=True)
    cells: list[Cell] = []
    systems: dict[str, dict[str, Any]] = {}
    for system in s.systems:
        info: dict[str, Any] = {}
        systems[system] = info
        runner = run_child if system in CHILD_SYSTEMS else run_served
        cells += runner(system, s, args, prompts, log_dir, info)
    table = rows(cells)
    tgts = targets(table)
    result = {"benchmark": NAME,
              "config": {"systems": list(s.systems), "loads": list(s.loads),
                         "batches": list(s.batches), "rounds": s.rounds,
                         "input_len": s.input_len, "output_len": s.output_len,
                         "settle_s": s.settle_s, "model": args.model or "default",
                         "autogroup": _autogroup()},
              "cells": table, "targets": tgts, "systems": systems,
              "wall_s": time.perf_counter() - t0, "machine": machine_info()}
    path = write_json(out, NAME, result)
    print()
    print(render_table(table))
    counts = {k: sum(r["verdict"] == k for r in table) for k in ("met", "MISSED")}
    print(f"targets: {counts['met']} met, {counts['MISSED']} MISSED, "
          f"{len(tgts) - counts['met'] - counts['MISSED']} without a figure")
    print(f"wrote {path}")
    return result


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _autogroup() -> str | None:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
