"""A scheduled step as the model runs it: its tensors decode-first, and the rows its prompt logprobs read.

Chunks are laid out decode-first so all single-token queries share one batched attention call;
a decode-only step may be padded to a batch-size bucket (``engine.executor.cuda_graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, SeqSlice, build_metadata
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.executor.cuda_graphs import PAD_TOKEN_ID, DecodePadding

PROMPT_LOGITS_ROWS = 256  # prompt-logprob logits per slice: 256 x a 49k vocabulary = 50 MB


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (padded rows included)
    meta: AttentionMetadata  # on the host; meta.positions: [T]
    order: list[ScheduledChunk]  # chunks in batch order
    # hidden-state rows sampled: each sampled chunk's last token, and before it the rows of a
    # verifying chunk's last token and drafts (chunk.num_draft + 1 rows, in order)
    sample_rows: list[int]
    sample_chunks: list[ScheduledChunk]
    # Decode-only step padded to this many sequences (dummies after the real ones); None: eager.
    bucket: int | None = None
    # Some chunk computes prompt tokens (not only decodes and drafts being verified): the
    # step multiplies fp32 activations (engine.ops.linear.exact_activations).
    has_prompt_rows: bool = False
    # Some chunk's request pools its hidden states (an embedding: SamplingParams.pooling).
    has_pooling: bool = False


@dataclass(frozen=True)
class PromptLogits:
    """One request's prompt logprobs in a step: ``slices`` of (first row, end row, the
    prompt tokens those rows predict); ``first_pos``: the position the first describes."""

    request_id: str
    first_pos: int
    k: int
    slices: list[tuple[int, int, list[int]]]


def prepare_step(sched: SchedulerOutput, block_size: int,
                 padding: DecodePadding | None = None) -> StepInputs:
    """The step's tensors, decode-first; a decode-only step is padded to its bucket when
    ``padding`` is given."""
    # A verifying chunk (its last token and drafts) runs as decode rows, one per position,
    # each attending to the slots before it: the step stays a decode step (the fused decode
    # kernel, CUDA graphs, the decode attention paths), and its rows get the arithmetic
    # decode rows get.
    decodes = [c for c in sched.chunks if c.num_tokens == 1 or c.num_draft or c.as_rows]
    prefills = [c for c in sched.chunks if c.num_tokens > 1 and not c.num_draft
                and not c.as_rows]
    order = decodes + prefills
    ids: list[int] = []
    seqs: list[SeqSlice] = []
    for c in order:
        ids.extend(c.token_ids)
        if c.num_draft or c.as_rows:
            seqs.extend(SeqSlice(c.block_ids, c.start_pos + j, 1) for j in range(c.num_tokens))
        else:
            seqs.append(SeqSlice(c.block_ids, c.start_pos, c.num_tokens))
    bucket = None
    if padding is not None:
        bucket = padding.bucket_for(seqs)
        if bucket is not None:
            ids.extend([PAD_TOKEN_ID] * (bucket - len(seqs)))
            seqs = padding.pad(seqs, bucket)
    meta = build_metadata(seqs, block_size)
    sample_rows, sample_chunks = [], []
    row = 0
    for c in order:
        row += c.num_tokens
        if c.sample:
            sample_rows.extend(range(row - 1 - c.num_draft, row))
            sample_chunks.append(c)
    prompt_rows = bool(prefills)
    return StepInputs(torch.tensor(ids, dtype=torch.int64), meta, order, sample_rows,
                      sample_chunks, bucket, prompt_rows,
                      any(c.sampling_params.pooling is not None for c in order))


def prompt_logit_plan(inp: StepInputs) -> list[PromptLogits]:
    """For each chunk whose request asked for prompt logprobs: the hidden-state rows
    whose logits give its positions' next prompt tokens, a slice of rows at a time (a
    whole long prompt's logits would be rows x vocabulary floats at once)."""
    plan = []
    row = 0
    for c in inp.order:
        k = c.sampling_params.prompt_logprobs
        last = min(c.end_pos, len(c.prompt_token_ids) - 1)  # positions with a next token
        if k is not None and c.start_pos < last:
            slices = []
            for p0 in range(c.start_pos, last, PROMPT_LOGITS_ROWS):
                p1 = min(p0 + PROMPT_LOGITS_ROWS, last)
                r0 = row + p0 - c.start_pos
                slices.append((r0, r0 + p1 - p0, list(c.prompt_token_ids[p0 + 1:p1 + 1])))
            plan.append(PromptLogits(c.request_id, c.start_pos + 1, k, slices))
        row += c.num_tokens
    return plan
