"""A worker Ray restarted, taken back by the orchestrator (``Orchestrator.rejoin``)."""

from __future__ import annotations

import logging

from router.control.request_state import WorkerSlot
from worker_protocol import WorkerInfo

log = logging.getLogger(__name__)


def rejoin(orch, slot: WorkerSlot, info: WorkerInfo) -> None:
    """``slot``'s worker was restarted by Ray (same id and handle, new process): take its
    new ``info``, move its old process's streams, route to it again (its pool is empty;
    in-flight counters stay, owned by the attempts that raised them). Its LoRA adapters are
    gone with the old process: requests naming one load it there again on first use."""
    old, wid = slot.info, info.worker_id
    if old.role != "prefill":
        orch.fanout.fail_committed_streams(
            wid, f"decode worker {wid} restarted (pid {old.pid} -> {info.pid})",
            "worker_restarted", keep_incarnation=info.incarnation)
    slot.info = info
    view = slot.view
    view.alive, view.load, view.kv_unreachable_until = True, None, 0.0
    view.kv_blocks_total = info.num_kv_blocks
    view.restarts += 1
    orch.kv_sync.track(wid, info.block_size)  # its cache is new: stale until a snapshot
    orch.health.reachable(slot)
    if old.role != "prefill":
        orch.fanout.start(slot)
    orch.heartbeats.watch(slot)  # a new process: a new clock and lifeline
    log.warning("worker %s rejoined after a restart: pid %d -> %d, KV address %s",
                wid, old.pid, info.pid, info.kv_address)
