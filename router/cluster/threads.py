"""How one machine's cores are split among the workers' torch threads (``pdcluster serve``).

A CPU engine's step is ~300 OpenMP parallel regions; each waits for the slowest thread of its
team. So how many threads each worker gets, and whether anything else wants those cores, sets
the step time as much as the kernels do. Measured on a 2-core box
(docs/history/2026-11-30-waves-1-2-serving.md, "Cores on small machines"):

- The router and Ray cost ~1 ms of CPU per output token (router process ~1.1 ms, Ray's
  daemons ~0.4 ms): a few percent of a core at the rates a small box serves, a whole core at
  ~600 tokens/s. On small boxes every core goes to the engines (a colocated worker with 1 of
  2 threads served 14-27% fewer tokens/s than with both); from ``ROUTER_CORE_FROM`` cores on,
  one is left to the router and Ray.
- The rest is split evenly among the workers (``--threads-per-worker``, or per role
  ``--prefill-threads`` / ``--decode-threads``), except that where a decode worker's share is
  one thread (a machine of 2-3 cores, 1 prefill + 1 decode), the prefill workers get every
  engine core: prefill comes in bursts, and a one-thread decode worker only loses its time
  slice while one runs (on 2 cores, prefill 2 threads + decode 1 against 1 + 1: TTFT p50
  28-38% lower, output tokens/s equal or up to 15% higher, decode ITL p99 lower at 1 and
  4 req/s). A decode team of several threads would stall on every preempted member.
- When prefill workers' threads share cores with decode workers (the split above), the
  prefill workers run with ``OMP_WAIT_POLICY=PASSIVE`` (their threads sleep between parallel
  regions instead of spinning), unless the operator set a policy: a burst then leaves the
  decode worker its core between regions (2 cores, prefill 2 + decode 1, two paired runs:
  output tokens/s at 4 req/s 86.7 and 85.9 with, 76.3 and 73.4 without; goodput 91% vs
  34-62%). Never for decode or colocated workers: waking a sleeping
  team costs every region, and their step is the token latency (a colocated batch-1 step
  took 35 ms with PASSIVE, 24 ms without, on an otherwise idle box).

The cores counted are the CPUs the router's process may use (its affinity mask and cgroup
quota: ``engine.runtime.cpu_threads.cpu_budget``): on a multi-node Ray cluster, set the thread flags
for the worker nodes. Each engine then runs fewer threads than planned while other processes
take its threads' time, and the planned count again once they stop (``engine.runtime.cpu_threads``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

# Machines with at least this many cores keep one for the router and Ray (see above).
ROUTER_CORE_FROM = 8
WAIT_POLICY = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class ThreadPlan:
    """Torch threads per worker of each role, and the environment prefill workers start
    with (read by the OpenMP runtime at process start)."""

    prefill_threads: int
    decode_threads: int  # decode or colocated workers
    prefill_env: dict[str, str] = field(default_factory=dict)
    summary: str = ""  # one line for the start-up banner


def plan_threads(cores: int, num_prefill: int, num_decode: int, *,
                 threads_per_worker: int | None = None, prefill_threads: int | None = None,
                 decode_threads: int | None = None,
                 environ: Mapping[str, str] = os.environ) -> ThreadPlan:
    """The split for ``num_prefill`` + ``num_decode`` workers (colocated: ``num_prefill`` 0)
    on a machine of ``cores``; flags given win over the default (cores less the router's,
    evenly among the workers, at least 1 each)."""
    if cores < 1 or num_prefill < 0 or num_decode < 1:
        raise ValueError(f"plan_threads: cores {cores}, prefill {num_prefill}, "
                         f"decode {num_decode}")
    router_core = cores >= ROUTER_CORE_FROM
    engine_cores = cores - 1 if router_core else cores
    even = max(1, engine_cores // (num_prefill + num_decode))
    d = decode_threads or threads_per_worker or even
    # Prefill runs in bursts: a one-thread decode worker loses only its time slice while a
    # burst runs, so prefill may take every engine core; a decode team of several threads
    # would stall on each preempted member, so then the split stays even.
    p = prefill_threads or threads_per_worker or (
        max(1, engine_cores // num_prefill) if num_prefill and d == 1 else even)
    wanted = num_prefill * p + num_decode * d + 1  # + the router's
    env: dict[str, str] = {}
    if num_prefill and p > 1 and wanted > cores and WAIT_POLICY not in environ:
        env[WAIT_POLICY] = "PASSIVE"
    decode_role = "decode" if num_prefill else "colocated"
    roles = ([f"{num_prefill} prefill x {p}"] if num_prefill else [])
    roles.append(f"{num_decode} {decode_role} x {d}")
    summary = (f"{cores} cores: {' + '.join(roles)} threads"
               f"{', 1 core left to the router' if router_core and wanted <= cores else ''}"
               f"{'; prefill threads sleep when idle (cores shared)' if env else ''}")
    return ThreadPlan(p, d, env, summary)
