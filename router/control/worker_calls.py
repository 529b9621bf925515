"""One worker call of a request's attempt, and what its failure costs (the orchestrator's).

``call`` awaits a Ray call with a deadline and turns each way it can fail into the
orchestrator's lifecycle exceptions (retry elsewhere, aborted, misconfigured, the request's
own fault), freeing the attempt's reservation first and reporting the worker's health;
``safe_abort`` frees what a worker holds, best effort.
"""

from __future__ import annotations

import asyncio

from engine.contract import QueueFullError, RequestFailedError
from engine.lora.request import AdaptersBusyError
from kv_transfer import KVHandshakeError, KVPeerUnreachableError
from router.contract import WorkerTimeoutError
from router.control.request_state import (
    Aborted,
    ClusterMisconfiguredError,
    RetryElsewhere,
    StreamState,
    WorkerSlot,
    cause_of,
)
from router.control.worker_health import WorkerHealth
from worker_protocol import AbortRequest, control

__all__ = ["WorkerCalls"]


class WorkerCalls:
    def __init__(self, health: WorkerHealth, call_timeout_s: float) -> None:
        self.health = health
        self.call_timeout_s = call_timeout_s

    async def call(self, stream: StreamState, worker: WorkerSlot, call, timeout_s: float,
                   release: WorkerSlot | None = None, peer: WorkerSlot | None = None):
        """Await one worker call of an attempt, at most ``timeout_s``.

        On failure: free the reservation held on ``release``, then raise Aborted (we aborted
        it), ClusterMisconfiguredError (the KV handshake refused), or RetryElsewhere without
        the workers to blame: ``peer`` alone when it was its KV address that could not be
        reached (it is quarantined), else ``worker`` (and ``peer``, whose transfer it was)."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the call's result
            # when it lands as the caller is cancelled, and the cancellation is lost (a client
            # gone at that moment would leave its request running on).
            # A worker (or the peer of its transfer) declared silent meanwhile ends the wait
            # at once, as a timeout (WorkerHealth.silent).
            async with asyncio.timeout(timeout_s) as deadline:
                watched = [s.info.worker_id for s in (worker, peer) if s is not None]
                for wid in watched:
                    self.health.watch(wid, deadline)
                try:
                    return await call
                finally:
                    for wid in watched:
                        self.health.unwatch(wid, deadline)
        except KVHandshakeError as e:
            raise ClusterMisconfiguredError(str(cause_of(e))) from None
        except RequestFailedError as e:  # the request itself is at fault: no other worker
            if release is not None:      # would do better, so it is not retried
                await self.safe_abort(release, stream.request_id)
            raise RequestFailedError(str(cause_of(e))) from None
        except Exception as e:
            if worker.info.worker_id == stream.prefill_id:
                stream.prefill_id = None  # the failed prefill holds nothing to abort
            if release is not None:
                await self.safe_abort(release, stream.request_id)
            if stream.aborted:  # it failed because we aborted it: no retry
                raise Aborted from None
            if isinstance(cause_of(e), AdaptersBusyError):  # it waited (bounded) for one of
                raise QueueFullError(str(cause_of(e))) from None  # its adapters: 429, no retry
            if peer is not None and isinstance(e, KVPeerUnreachableError):
                self.health.quarantine(peer, str(cause_of(e)))
                raise RetryElsewhere(cause_of(e), [peer], peer.info.worker_id) from None
            if (isinstance(e, TimeoutError) and peer is not None and worker.view.reachable
                    and not peer.view.reachable):  # the peer went silent, not this worker
                raise RetryElsewhere(WorkerTimeoutError(
                    f"worker {peer.info.worker_id} went silent during the call"), [peer],
                    peer.info.worker_id) from None
            # Declared gone or silent while the call waited (its deadline was ended early).
            gone = _worker_gone(e) or (isinstance(e, TimeoutError) and not (
                worker.view.alive and worker.view.reachable))
            if isinstance(e, TimeoutError):
                e = WorkerTimeoutError(f"worker {worker.info.worker_id} " + (
                    "was lost during the call" if gone else
                    f"did not answer within {timeout_s:g}s"))
                self.health.unreachable(worker, str(e))
            else:
                self.health.on_error(worker, e)
            # The peer shares the blame of a failed transfer, not of the worker's own death
            # (excluding a healthy decode worker could leave the retry nowhere to go).
            blamed = [worker] if peer is None or gone else [worker, peer]
            raise RetryElsewhere(e, blamed, worker.info.worker_id) from None

    async def safe_abort(self, slot: WorkerSlot, rid: str) -> None:
        """Best effort: a worker that cannot be reached frees the reservation by its lease."""
        try:
            await asyncio.wait_for(control(slot.handle.abort).remote(AbortRequest(rid)),
                                   self.call_timeout_s)
        except TimeoutError:
            self.health.unreachable(slot, f"abort of {rid} timed out")
        except Exception as e:
            self.health.on_error(slot, e)


def _worker_gone(e: BaseException) -> bool:
    """Ray's word that the called actor itself died or is restarting (or unreachable)."""
    import ray.exceptions

    return isinstance(e, ray.exceptions.RayActorError)
