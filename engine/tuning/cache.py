"""The per-host timing cache every start-up tuning shares: ``cached_timings`` under a ``host_key``.

A tuning (the linear paths, ``engine.tuning.linear``; the attention paths,
``engine.attention.torch_tuning``; the whole-step decode kernel, ``engine.executor.fused_decode``)
measures a list of ``Timing`` once per host and reads it back afterwards from
``{cache_dir}/kernels/{kind}-{key}.json`` (``cache_dir`` default: ``~/.cache/pdcluster``). The
key names everything the timings depend on (``host_key``), so a second start on the same host
pays nothing and a different host (or thread count) times afresh.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.ops.linear import FP, LINEAR_BUCKETS, available_paths

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/pdcluster")


@dataclass(frozen=True)
class Timing:
    """Median seconds per call of each path for one weight shape and one M bucket."""

    n: int
    k: int
    m: int
    seconds: dict[str, float]
    kind: str = FP  # "fp", or the quantized layout ("int8", "int4")

    @property
    def best(self) -> str:
        return min(self.seconds, key=self.seconds.get)


def host_key(shapes: Iterable[tuple], dtype: torch.dtype, extra: str = "") -> str:
    """Names what the timings depend on: CPU model, torch, threads, dtype, shapes, the linear
    paths on offer and their buckets (in every key, whatever was timed: the keys of caches
    already on disk stay valid), and ``extra`` (e.g. which build of a kernel library was
    timed)."""
    parts = [_cpu_model(), torch.__version__, str(torch.get_num_threads()), str(dtype),
             ",".join("x".join(map(str, s)) for s in sorted(set(shapes))),
             ",".join(map(str, LINEAR_BUCKETS)),
             ",".join(available_paths()), extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class NotCached(LookupError):
    """Raised by ``cached_timings`` under ``cache_only`` when this host has no entry."""


_CACHE_ONLY = contextvars.ContextVar("pdcluster_kernels_cache_only", default=False)


@contextlib.contextmanager
def cache_only():
    """Inside: ``cached_timings`` reads the cache and raises NotCached instead of timing."""
    token = _CACHE_ONLY.set(True)
    try:
        yield
    finally:
        _CACHE_ONLY.reset(token)


def cached_timings(kind: str, key: str, measure: Callable[[], list[Timing]],
                   cache_dir: str | Path | None = None) -> tuple[list[Timing], bool]:
    """``measure()``'s timings, cached in ``{cache_dir}/kernels/{kind}-{key}.json``, and
    whether they came from the cache. One process measures at a time (a file lock): workers
    starting together on one host would time each other's memory traffic; the others wait,
    then read its result."""
    path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "kernels" / f"{kind}-{key}.json"
    cached = _read_timings(path, key)
    if cached is not None:
        return cached, True
    if _CACHE_ONLY.get():
        raise NotCached(f"{kind}-{key}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 (held across the measuring)
    except OSError as e:
        log.warning("cannot cache kernel timings in %s: %s", path.parent, e)
        return measure(), False
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_timings(path, key)
        if cached is not None:
            return cached, True
        timings = measure()
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "timings": [asdict(t) for t in timings]}))
            tmp.replace(path)  # atomic: a reader never sees half a file
        except OSError as e:
            log.warning("cannot cache kernel timings at %s: %s", path, e)
        return timings, False


def _read_timings(path: Path, key: str) -> list[Timing] | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return [Timing(**t) for t in data["timings"]]
    except (OSError, ValueError, TypeError, KeyError):
        pass  # missing or unreadable: measure again
    return None
