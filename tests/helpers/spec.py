"""What the speculative-decoding tests share: a config that verifies every draft every step,
and prompts that repeat themselves (so prompt-lookup finds drafts)."""

from __future__ import annotations

import random

# Every step verifies every draft it has (adaptive off): the paths under test run each step.
EVERY_STEP = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, "adaptive": False}


def repetitive_prompts() -> list[list[int]]:
    """Ten prompts of the tiny vocabulary that repeat a short unit, of 5 to 68 tokens."""
    rng = random.Random(7)
    prompts = []
    for i in range(10):
        unit = [rng.randrange(3, 256) for _ in range(3 + i % 4)]
        prompts.append((unit * (2 + i % 5))[:5 + 7 * i])
    return prompts
