"""A followed stream log that stops growing asks its router to rescue the request, and asks
again while it stays still: a rescue that could not decide the first time (a decode worker
restarting and not answering yet) must not leave the client waiting for the stall timeout."""

from __future__ import annotations

import asyncio

from engine.contract import SamplingParams
from router.state.memory import InMemoryStore
from router.state.stream_log import StreamLogger


def test_a_still_log_reports_its_stall_again_until_it_grows():
    logger = StreamLogger(InMemoryStore(), "m", None, poll_s=0.005, stall_s=60.0,
                          orphan_after_s=0.05)
    logger.open("r", [1, 2, 3], SamplingParams(max_tokens=4), chat=False)
    logger.append("r", [7], None)
    asked: list[str] = []

    async def on_stall(request_id: str) -> None:
        asked.append(request_id)
        if len(asked) == 3:  # the third ask finds a way: the rest of the stream arrives
            logger.append(request_id, [8, 9], "length")

    logger.on_stall = on_stall

    async def follow() -> list:
        return [c async for c in logger.resume("r")]

    chunks = asyncio.run(asyncio.wait_for(follow(), 30))
    assert asked == ["r", "r", "r"]  # asked again after each still spell, until it grew
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
