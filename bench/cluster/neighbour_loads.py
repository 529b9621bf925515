"""The processes and loads of ``pdcluster bench neighbour``: a system's processes from
``/proc`` (process groups and their descendants), free ports, the busy neighbour, the
CPU-quota cgroup, applying a load around a measurement, and ending a server's group."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster.neighbour_table import BUSY_LOOP, NICE, QUOTA_PERIOD_US

# ---- process groups, ports -------------------------------------------------------------------

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


def process_name(pid: int) -> str:
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


# ---- ending a server -------------------------------------------------------------------------

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
