"""Resumable streams: every request's generated token ids go to the store's stream log as
they stream, and any router of the deployment can replay a log and follow it live.

``StreamLogger`` is used by both backends:
- ``open`` / ``append`` are called by whoever produces a request's tokens (the orchestrator,
  the embedded engine backend), with every update and the finish reason;
- ``keep`` wraps that producer for the front door: when the client goes away from a request
  that asked to be resumable (``GenerateInput.resumable``), the producer is NOT closed (which
  would abort the request); a background task drains it into the log instead, so a client
  that reconnects finds every token. Requests that did not ask are aborted as before (their
  KV freed at once);
- ``resume(request_id, from_index)`` replays the log from token ``from_index`` and follows it
  until the request ends, as ``GenerationChunk``s like the original stream's (text is
  re-derived from the tokens, cut at the same stop strings);
- ``adopt`` keeps the log of a request whose router died going: the router that re-attached
  to its decode worker hands over each token update it gets for a request it does not know.
  Updates carry their stream position, so writes are idempotent, and a gap (tokens the dead
  router received but never logged) is filled from the worker's own record of the request.
  Should that worker die too, ``take_adopted`` tells the router which requests to continue
  itself (router/control/orphans.py);
- a followed log that stops growing for ``orphan_after_s`` calls ``on_stall``, and again after
  each further ``orphan_after_s`` without growth: a request whose router and decode worker
  both died has nobody to hand it over, and the router the client resumed on continues it
  (router/control/orphans.py) once it can tell no live worker holds it.

A log lives ``stream_ttl_s`` (10 min) after its last append, in Redis with ``--redis-url``
(so another router can resume it), else in the router's memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.contract import SamplingParams
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from router.contract import GenerateInput, GenerationChunk, StreamNotFoundError, Usage
from router.state.store import ClusterStore, StreamRecord
from worker_protocol import RequestTokens, TokenUpdate

__all__ = ["StreamLogger"]

log = logging.getLogger(__name__)

_OPEN_GRACE_S = 1.0  # a log opened a moment ago may still sit in the store's write queue


class StreamLogger:
    def __init__(self, store: ClusterStore, model_id: str, tokenizer: Tokenizer | None,
                 poll_s: float = 0.02, stall_s: float = 120.0,
                 orphan_after_s: float = 20.0, owner: str | None = None) -> None:
        """``owner``: the producing router's id. Its logs are opened under it and its
        appends are fenced by it: once another router claimed a log (it continues the
        request), this one's writes to it are dropped. None: no fencing (one process)."""
        self.store = store
        self.owner = owner
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.poll_s = poll_s
        self.stall_s = stall_s  # a followed log that grows no more for this long ends
        # ... and after this long without growth, on_stall(request_id) is awaited, and again
        # after each further orphan_after_s it stays still: the owner may have lost the
        # request (router/control/orphans.py), and a rescue that could not decide (a decode
        # worker restarting, not answering yet) must be asked again, not given up.
        self.orphan_after_s = orphan_after_s
        self.on_stall: Callable[[str], Awaitable[None]] | None = None
        self._drains: set[asyncio.Task] = set()
        # Adopted requests: id -> tokens in its log (None: not ours to write: unknown, ended,
        # or continued by this router itself), and the decode worker each came from.
        self._adopted: dict[str, int | None] = {}
        self._adopted_from: dict[str, str] = {}
        self._adoptions: asyncio.Queue | None = None
        self._adopter: asyncio.Task | None = None

    # ---- the producer's side --------------------------------------------------------------
    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             chat: bool, model: str | None = None) -> None:
        """Start the log, owned by this logger's owner. It holds the prompt, the sampling
        parameters and ``model`` (a LoRA adapter's name; None: the base model) too, so another
        router can continue the request if its router and its decode worker both die."""
        self.store.stream_open(StreamRecord(
            request_id, len(prompt_token_ids), params.max_tokens, list(params.stop),
            params.include_stop_str_in_output, model or self.model_id,
            "chat" if chat else "completion",
            list(prompt_token_ids), dataclasses.asdict(params), self.owner or ""))

    def append(self, request_id: str, token_ids: list[int], finish_reason: str | None) -> None:
        self.store.stream_append(request_id, token_ids, finish_reason, self.owner)

    def adopt(self, update: TokenUpdate, fetch: Callable[[str], Awaitable[RequestTokens | None]],
              worker_id: str = "") -> None:
        """A token update from decode worker ``worker_id`` for a request no stream of this
        router owns (its router died, or it ended here already). ``fetch(request_id)`` asks
        that worker for everything it generated. Never blocks: the writes happen in order on
        a task of their own."""
        if update.index < 0:
            return
        if worker_id:
            self._adopted_from[update.request_id] = worker_id
        if self._adoptions is None:
            self._adoptions = asyncio.Queue()
            self._adopter = asyncio.ensure_future(self._adopt_loop())
        self._adoptions.put_nowait((update, fetch))

    async def _adopt_loop(self) -> None:
        while True:
            update, fetch = await self._adoptions.get()
            try:
                await self._adopt_one(update, fetch)
            except Exception as e:  # the store or the worker is away: the log stays short
                log.warning("could not log tokens of adopted request %s: %r",
                            update.request_id, e)

    async def _adopt_one(self, upd: TokenUpdate, fetch) -> None:
        rid = upd.request_id
        if rid not in self._adopted:
            current = await asyncio.to_thread(self.store.stream_read, rid, 2**31)
            known = None if current is None or current.finish_reason else current.num_tokens
            if (known is not None and self.owner is not None and current.owner != self.owner
                    and not await asyncio.to_thread(self.store.stream_claim, rid, self.owner,
                                                    current.owner)):
                known = None  # another router claimed it first: its log is theirs to write
            self._adopted[rid] = known
            if known is not None:
                log.warning("adopting %s (its router is gone) at token %d", rid, known)
            if len(self._adopted) > 65536:
                oldest = next(iter(self._adopted))
                del self._adopted[oldest]
                self._adopted_from.pop(oldest, None)
        known = self._adopted.get(rid)
        if known is None:
            return
        if upd.index > known:  # a gap: fill it from the worker's record
            rec = await fetch(rid)
            if self._adopted.get(rid) is None:  # taken over meanwhile (take_adopted)
                return
            if rec is None or rec.index > known:
                log.warning("cannot fill tokens %d..%d of %s: its worker no longer has them",
                            known, upd.index, rid)
                self._adopted[rid] = None
                return
            tokens, reason = rec.token_ids[known - rec.index:], rec.finish_reason
        else:
            tokens, reason = upd.new_token_ids[known - upd.index:], upd.finish_reason
        self.append(rid, tokens, reason)
        self._adopted[rid] = None if reason else known + len(tokens)
        if reason:
            self._adopted_from.pop(rid, None)

    def take_adopted(self, worker_id: str) -> list[str]:
        """The adopted requests still live on ``worker_id``, which was just lost: their logs
        are no longer written from its updates (updates already queued are dropped), and the
        caller continues them elsewhere."""
        # Not in _adopted yet: its first update is still queued (it is dropped, as above).
        taken = [rid for rid, wid in self._adopted_from.items()
                 if wid == worker_id and self._adopted.get(rid, 0) is not None]
        for rid in taken:
            self._adopted[rid] = None
            del self._adopted_from[rid]
        return taken

    # ---- the front door's side ------------------------------------------------------------
    async def keep(self, inp: GenerateInput, chunks: AsyncIterator[GenerationChunk]
                   ) -> AsyncIterator[GenerationChunk]:
        """Re-yield ``chunks``. Closed or cancelled early, the request is aborted, unless it
        is resumable: then it runs on into its log. A resumable request's producer runs in
        a task of its own, so the client's cancellation never reaches it. ``inp.permit`` is
        taken over here and released when the generation ends (not the call)."""
        permit = inp.permit.adopt() if inp.permit is not None else None
        if not inp.resumable:
            try:
                async for c in chunks:
                    yield c
            finally:
                try:
                    await chunks.aclose()
                finally:
                    if permit is not None:
                        permit.release()
            return
        queue: asyncio.Queue = asyncio.Queue()
        listening = [True]
        pump = asyncio.ensure_future(self._pump(chunks, queue, listening, permit))
        self._drains.add(pump)
        pump.add_done_callback(self._drains.discard)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            listening[0] = False
            if not finished and not pump.done():
                log.info("client of %s went away; it runs on into its stream log",
                         inp.request_id)

    @staticmethod
    async def _pump(chunks: AsyncIterator[GenerationChunk], queue: asyncio.Queue,
                    listening: list[bool], permit) -> None:
        """Run the producer to its end (it logs every update itself), handing chunks to the
        client while one listens; an error goes to the client, or to the log alone."""
        try:
            async for c in chunks:
                if listening[0]:
                    queue.put_nowait(c)
            queue.put_nowait(None)
        except asyncio.CancelledError:  # shutdown
            raise
        except Exception as e:
            if listening[0]:
                queue.put_nowait(e)
            else:
                log.info("detached request ended with %r", e)
        finally:
            try:
                await chunks.aclose()
            finally:
                if permit is not None:
                    permit.release()

    async def close(self) -> None:
        """Abort the resumable requests still running (shutdown)."""
        tasks = [*self._drains, *([self._adopter] if self._adopter else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def kind(self, request_id: str) -> str | None:
        """How the request was asked for ("chat" | "completion"); None if no log."""
        log_ = await asyncio.to_thread(self.store.stream_read, request_id, 2**31)
        return log_.record.kind if log_ is not None else None

    async def resume(self, request_id: str, from_index: int = 0
                     ) -> AsyncIterator[GenerationChunk]:
        """The stream of ``request_id`` from token ``from_index`` on, followed live until it
        ends. Raises StreamNotFoundError (NOT_FOUND / 404) for an unknown or expired id, and
        ValueError for a negative index."""
        if from_index < 0:
            raise ValueError(f"from_index must be >= 0, got {from_index}")
        first = await asyncio.to_thread(self.store.stream_read, request_id, 0)
        deadline = time.monotonic() + _OPEN_GRACE_S
        while first is None and time.monotonic() < deadline:  # its opening may be queued
            await asyncio.sleep(self.poll_s)
            first = await asyncio.to_thread(self.store.stream_read, request_id, 0)
        if first is None:
            raise StreamNotFoundError(f"no stream {request_id!r} here (unknown, or expired "
                                      f"{int(getattr(self.store, 'stream_ttl_s', 600))} s "
                                      f"after its last token)")
        rec = first.record
        detok = (IncrementalDetokenizer(self.tokenizer, [], stop=rec.stop,
                                        include_stop_str_in_output=rec.include_stop_str_in_output,
                                        stop_token_ids=rec.sampling.get("stop_token_ids", ()))
                 if self.tokenizer is not None else None)
        seen, last_growth, current = 0, time.monotonic(), first
        stall_reported_at: float | None = None
        while True:
            reason = current.finish_reason
            for tok in current.token_ids:  # one token per chunk, as the original streamed
                index, seen = seen, seen + 1
                delta = detok.update([tok]).delta_text if detok is not None else ""
                stopped = detok is not None and detok.stopped
                ended = stopped or (reason is not None and seen == current.num_tokens)
                if ended and detok is not None:
                    delta += detok.flush()
                if index >= from_index or ended:
                    mine = index >= from_index  # the client has the earlier ones
                    yield GenerationChunk(
                        request_id, [tok] if mine else [], delta if mine else "", ended,
                        (reason or "stop") if ended else None,
                        Usage(rec.num_prompt_tokens, seen) if ended else None, None,
                        rec.num_prompt_tokens)
                if ended:
                    return
            if reason is not None:  # it ended with no token after the last one read
                yield GenerationChunk(request_id, [], detok.flush() if detok else "", True,
                                      reason, Usage(rec.num_prompt_tokens, seen), None,
                                      rec.num_prompt_tokens)
                return
            if current.token_ids:
                last_growth = time.monotonic()
            elif time.monotonic() - last_growth > self.stall_s:
                raise StreamNotFoundError(f"stream {request_id!r} stopped growing "
                                          f"{self.stall_s:g} s ago without an end")
            elif (self.on_stall is not None
                  and time.monotonic() - last_growth > self.orphan_after_s
                  and (stall_reported_at is None
                       or time.monotonic() - stall_reported_at > self.orphan_after_s)):
                stall_reported_at = time.monotonic()
                await self.on_stall(request_id)
            await asyncio.sleep(self.poll_s)
            nxt = await asyncio.to_thread(self.store.stream_read, request_id, seen)
            if nxt is None:
                raise StreamNotFoundError(f"stream {request_id!r} expired while followed")
            current = nxt
