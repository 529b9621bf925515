"""Embeddings: a prompt's final hidden states (after the model's last norm) pooled into one
vector (``SamplingParams.pooling``). ``last``: the last prompt token's row (what a decoder LM
has seen the whole prompt at: the default); ``mean``: the average of every prompt token's row;
``cls``: the first token's row. ``normalize``: L2-normalized (cosine similarity by dot product).

A prompt may be computed over several steps (chunked prefill): each step's rows of a pooling
request give one part (``pool_parts``); the request keeps them (``Request.pooled``) and its
last output joins them (``join_parts``). ``mean`` and ``cls`` need every prompt row, so their
prompts are computed whole, not taken from the prefix cache (as prompt logprobs are); ``last``
needs only the last, which is always computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.executor.step_inputs import StepInputs


@dataclass(frozen=True)
class PooledPart:
    """One step's share of a request's pooled vector: the sum of its rows (``mean``), the
    first row (``cls``, the chunk at position 0) or the last (``last``, the chunk that ends the
    prompt); ``None`` rows are a chunk with nothing to give (a ``cls`` chunk past position 0)."""

    kind: str
    vector: torch.Tensor | None


def pool_parts(inp: StepInputs, hidden: torch.Tensor) -> dict[str, PooledPart]:
    """Request id -> its part, for every chunk of a pooling request in the step (``hidden``:
    the step's final hidden states, one row per token in ``inp.order``)."""
    out: dict[str, PooledPart] = {}
    row = 0
    for c in inp.order:
        kind = c.sampling_params.pooling
        if kind is not None:
            rows = hidden[row:row + c.num_tokens]
            if kind == "mean":
                vec = rows.float().sum(dim=0)
            elif kind == "cls":
                vec = rows[0].float().clone() if c.start_pos == 0 else None
            else:  # last: the chunk that ends the prompt holds it
                vec = rows[-1].float().clone() if c.end_pos >= len(c.prompt_token_ids) else None
            out[c.request_id] = PooledPart(kind, vec)
        row += c.num_tokens
    return out


def join_parts(parts: list[PooledPart], num_prompt_tokens: int, normalize: bool) -> list[float]:
    """The request's embedding from its parts, in step order. Raises ValueError when a part
    it needs never came (a bug: the prompt ran without its rows)."""
    vecs = [p.vector for p in parts if p.vector is not None]
    if not vecs:
        raise ValueError("no pooled rows: the prompt's hidden states were never computed")
    kind = parts[0].kind
    if kind == "mean":
        v = torch.stack(vecs).sum(dim=0) / num_prompt_tokens
    elif kind == "cls":
        v = vecs[0]
    else:
        v = vecs[-1]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.tolist()
