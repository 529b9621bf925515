"""A committed stream's next token update, and when silence means its worker lost it.

Death and silence of a decode worker are found by other means and sooner (its lifeline,
heartbeats, missed load reports: router/control/heartbeat.py, worker_health.py). The token
timeout is the backstop for a stream lost on a worker that still answers, so it counts only
time the request spent in the worker's batch: a request queued behind others (a busy worker,
``max_num_seqs`` reached, preempted) waits as long as the worker keeps stepping. On expiry the
worker is asked where the request stands (``progress``, a liveness call that never waits for
the engine); the stream is taken for lost only when it has been in the batch for the whole
timeout with no token, the worker does not know it, its engine has been inside one step for
the whole timeout (stuck, not busy), or the worker cannot answer within the timeout.
"""

from __future__ import annotations

import asyncio
import logging

from engine.contract import RequestProgress
from router.control.request_state import StreamState, WorkerLost, WorkerSlot
from worker_protocol import TokenUpdate, liveness

log = logging.getLogger(__name__)

__all__ = ["next_update"]


async def next_update(stream: StreamState, slot: WorkerSlot | None,
                      token_timeout_s: float) -> TokenUpdate | BaseException:
    """The stream's next queued item (a token update, a ``WorkerLost``, an error); a
    ``WorkerLost`` (``token_timeout``) once ``slot`` (its decode worker) says the request was
    in its batch ``token_timeout_s`` with no token, or does not know it, or does not answer."""
    wait = token_timeout_s
    while True:
        upd = await stream.next_update(wait)
        if not (isinstance(upd, WorkerLost) and upd.reason == "token_timeout"):
            return upd
        if slot is None:
            return upd
        try:  # a liveness call: it answers at once, whatever the engine is doing
            progress: RequestProgress = await _bounded(
                liveness(slot.handle.progress).remote(stream.request_id), token_timeout_s)
        except Exception as e:
            return WorkerLost(f"{upd}; asked where it stands, the worker did not answer: "
                              f"{e!r}"[:500], "token_timeout")
        if not stream.queue.empty():  # a token landed while we asked
            wait = token_timeout_s
            continue
        if progress.stalled_s >= token_timeout_s:  # one step that never ends: stuck, not busy
            return WorkerLost(f"{upd} (its engine has been in one step for "
                              f"{progress.stalled_s:.1f} s)", "token_timeout")
        if progress.state == RequestProgress.QUEUED:
            log.info("%s is queued on %s after %g s without a token: waiting on",
                     stream.request_id, slot.info.worker_id, token_timeout_s)
            wait = token_timeout_s
        elif progress.state == RequestProgress.RUNNING and progress.running_s < token_timeout_s:
            wait = token_timeout_s - progress.running_s  # it left the queue within the window
        else:
            return WorkerLost(f"{upd} ({progress.state} there"
                              + (f" for {progress.running_s:.1f} s)"
                                 if progress.state == RequestProgress.RUNNING else ")"),
                              "token_timeout")


async def _bounded(ref, timeout_s: float):
    # asyncio.timeout, not wait_for: see WorkerCalls.call (a cancelled caller must end).
    async with asyncio.timeout(timeout_s):
        return await ref
