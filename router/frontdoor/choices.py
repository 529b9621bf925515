"""The choices of one request (``n`` per prompt, and a batch of prompts) as one stream, for both
front doors (OpenAI HTTP and gRPC).

Each choice is a generation of its own (its own request id, KV and permit). The ``n`` choices
of a prompt share its KV through the prefix cache rather than computing it ``n`` times: the
first choice of each prompt (its leader) starts at once, the others when the leader's first
chunk arrives, i.e. once the prompt's KV exists (and, in a cluster, once the router's KV index
has heard of it, so they are routed to it). They then only compute the prompt's last, partial
block. ``ChoiceStreams`` merges every choice's chunks in arrival order, tagged with the
choice's index; closing it closes every backend stream (which aborts what still runs).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from router.contract import GenerateInput, GenerationChunk, Usage

__all__ = ["ChoiceChunk", "ChoiceStreams"]

_END = object()


@dataclass(frozen=True)
class ChoiceChunk:
    index: int
    chunk: GenerationChunk


class ChoiceStreams:
    """Every choice's backend stream, merged. ``inputs`` in OpenAI's order; ``n`` choices per
    prompt (consecutive). ``open_stream`` opens one backend stream."""

    def __init__(self, open_stream: Callable[[GenerateInput], AsyncIterator[GenerationChunk]],
                 inputs: list[GenerateInput], n: int) -> None:
        self._open = open_stream
        self._inputs = inputs
        self._n = n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffered: list[ChoiceChunk] = []
        self._running = len(inputs)
        self.usage_by_index: dict[int, Usage] = {}

    def start(self) -> None:
        leaders_started = [asyncio.Event() for _ in range(0, len(self._inputs), self._n)]
        self._tasks = [asyncio.ensure_future(self._pump(i, inp, leaders_started[i // self._n]))
                       for i, inp in enumerate(self._inputs)]

    async def _pump(self, index: int, inp: GenerateInput, leader_started: asyncio.Event) -> None:
        leader = index % self._n == 0
        stream = None
        try:
            if not leader:
                await leader_started.wait()
            stream = self._open(inp)
            async for c in stream:
                if leader:
                    leader_started.set()
                await self._queue.put(ChoiceChunk(index, c))
        except Exception as e:  # reported once, by the merged stream
            await self._queue.put(e)
        finally:
            if leader:
                leader_started.set()  # its followers start (and fail alike) even if it failed
            if stream is not None:
                await stream.aclose()
            self._queue.put_nowait(_END)

    async def _next(self) -> ChoiceChunk | None:
        """The next chunk of any choice; None once every choice ended. Raises what a choice
        raised."""
        while self._running:
            item = await self._queue.get()
            if item is _END:
                self._running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            if item.chunk.finished and item.chunk.usage is not None:
                self.usage_by_index[item.index] = item.chunk.usage
            return item
        return None

    async def prime(self) -> None:
        """Wait for every prompt's first chunk (or the end of its choices), so that a bad
        prompt anywhere in a batch raises here, before a response starts."""
        pending = set(range(0, len(self._inputs), self._n))
        while pending:
            item = await self._next()
            if item is None:
                return
            self._buffered.append(item)
            pending.discard(item.index - item.index % self._n)

    async def events(self) -> AsyncIterator[ChoiceChunk]:
        while self._buffered:
            yield self._buffered.pop(0)
        while (item := await self._next()) is not None:
            yield item

    def usage(self) -> Usage:
        """The request's usage: each prompt counted once, every choice's completion."""
        got = self.usage_by_index
        prompt = sum(u.prompt_tokens for i, u in got.items() if i % self._n == 0)
        return Usage(prompt, sum(u.completion_tokens for u in got.values()))

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
