"""Per-request ``priority`` (vLLM's meaning: lower runs first) behind the embedded backend:
of two requests queued behind a running one, the lower value starts first whatever their
arrival order; a value outside [-1000, 1000] is refused before anything is queued."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineArgs, SamplingParams
from router.contract import GenerateInput, InvalidRequestError
from router.embedded import EngineBackend
from tests.helpers.tiny_models import random_prompts


def test_the_lower_priority_value_starts_first_and_bad_values_are_refused(tiny_llama_dir):
    # max_num_seqs=1: one request runs at a time, so the queue's order is the start order
    backend = EngineBackend(EngineArgs(model=str(tiny_llama_dir), max_num_seqs=1))
    prompts = random_prompts(seed=51, count=4, max_len=12, min_len=4)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    started: list[str] = []

    async def run(name, prompt, params, priority):
        async for _ in backend.generate(GenerateInput(params, token_ids=prompt,
                                                      request_id=name, priority=priority)):
            if name not in started:
                started.append(name)

    async def body():
        first = asyncio.ensure_future(run("running", prompts[0], long, 0))
        while not started:
            await asyncio.sleep(0.001)
        queued = [asyncio.ensure_future(run(n, p, short, prio)) for n, p, prio in
                  (("later", prompts[1], 10), ("default", prompts[2], 0),
                   ("urgent", prompts[3], -10))]
        while len(backend.engine.scheduler.waiting) < 3:
            await asyncio.sleep(0.001)
        running_then = first.done()
        await asyncio.gather(first, *queued)
        errors = []
        for bad in (1001, -1001, 1.5):
            try:
                await run("bad", prompts[0], short, bad)
            except InvalidRequestError as e:
                errors.append(str(e))
        return running_then, errors

    try:
        running_then, errors = asyncio.run(body())
    finally:
        asyncio.run(backend.shutdown())
    assert not running_then, "the first request ended before the others queued"
    assert started == ["running", "urgent", "default", "later"]
    assert len(errors) == 3 and all("priority must be an integer in [-1000, 1000]" in e
                                    for e in errors)


@pytest.mark.parametrize("value", [1001, -1001])
def test_the_doors_refuse_a_priority_outside_the_range(value):
    from router.frontdoor.openai.schema import CompletionRequest

    with pytest.raises(ValueError, match="priority"):
        CompletionRequest(prompt="x", priority=value)
