"""A step's sampled rows -> each chunk's tokens, verifying speculative drafts.

A verifying chunk (``ScheduledChunk.num_draft`` = k > 0) holds its last token and k drafts;
row i of its k + 1 sampled rows is the target model's own choice for the position after draft
i (row 0: after the last token), sampled by the request's own rules (greedy, or its
temperature and truncations with the noise ``engine.executor.sampling`` draws for that output
index) as if drafts 1..i had been generated. Draft i + 1 is accepted while it equals row i's
token; the first row that disagrees gives the chunk's last token (or, all accepted, row k
gives one more). So the output is, token by token, what the request would have sampled
without speculation (identical for greedy and seeded requests, up to the arithmetic of a
different batch shape; equal in distribution otherwise): the drafts decide only how many
positions one step settles.

This is speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for a draft that
proposes one token with certainty (q(d) = 1: n-gram lookup, greedy drafts): accept d with
probability min(1, p(d) / q(d)) = p(d), else draw from max(0, p - q) normalised, which is p
without d. Drawing from p and accepting when the draw is d does exactly that.
"""

from __future__ import annotations

from engine.contract import TokenLogprob
from engine.core.scheduler import ModelRunnerOutput, ScheduledChunk


def accepted_length(drafts: list[int], tokens: list[int]) -> int:
    """How many ``drafts`` hold, given the target's ``tokens`` (one more than drafts)."""
    j = 0
    while j < len(drafts) and tokens[j] == drafts[j]:
        j += 1
    return j


def verified_output(chunks: list[ScheduledChunk], tokens: list, lps: list,
                    failed: dict[int, str], prompt_lps: dict) -> ModelRunnerOutput:
    """``tokens`` / ``lps``: each sampled row's token and logprob (None where not asked), the
    rows of ``chunks`` in order (``num_draft + 1`` each); ``failed``: chunk index -> why its
    sampling failed."""
    out = ModelRunnerOutput(prompt_logprobs=prompt_lps)
    row = 0
    for ci, c in enumerate(chunks):
        n = c.num_draft + 1
        rid = c.request_id
        if ci in failed:
            out.failed[rid] = failed[ci]
        elif not c.num_draft:
            out.sampled_token_ids[rid] = tokens[row]
            if lps[row] is not None:
                out.logprobs[rid] = lps[row]
        else:
            toks = tokens[row:row + n]
            keep = accepted_length(c.token_ids[1:], toks) + 1
            out.spec_token_ids[rid] = toks[:keep]
            chosen: list[TokenLogprob] = [lp for lp in lps[row:row + keep] if lp is not None]
            if chosen:
                out.spec_logprobs[rid] = chosen
        row += n
    return out
