"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
min_tokens, and the logit adjustments (logit_bias, repetition / frequency / presence penalties).

The order is vLLM's: stop tokens suppressed (min_tokens), logit_bias, penalties, then greedy
argmax or temperature -> min_p -> top-k -> top-p -> the draw. Rows that set none of the
adjustments pay nothing for them (one attribute test per row and step).

Penalties count a request's *generated* tokens. A request that migrated carries the tokens it
generated elsewhere at the end of its prompt (``SamplingParams.sample_index_offset`` of them),
and they count as generated, so its stream stays the one an undisturbed run would produce.

Seeded requests draw each token from a generator seeded by ``(seed, output index)``, so a
request's samples do not depend on what it was batched with, on preemption, or on which worker
(prefill or decode) produced the token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams, TokenLogprob

_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one request's row of logits."""

    params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    # References into the request (never mutated here); read only when a penalty is set.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()

    def generated_token_ids(self) -> list[int]:
        """Every token this request generated, here and (before a migration) elsewhere."""
        moved = self.params.sample_index_offset
        earlier = list(self.prompt_token_ids[len(self.prompt_token_ids) - moved:]) if moved else []
        return earlier + list(self.output_token_ids)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """``logits [N, vocab]`` (fp32) -> one token id per row."""
    _suppress_stop_tokens(logits, rows)
    for i, r in enumerate(rows):
        if r.params.adjusts_logits:
            _adjust_logits(logits[i], r)
    if all(r.params.greedy for r in rows):
        return logits.argmax(dim=-1).tolist()
    out = [0] * len(rows)
    greedy_idx = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy_idx:
        for i, tok in zip(greedy_idx, logits[greedy_idx].argmax(dim=-1).tolist(), strict=True):
            out[i] = tok
    rand_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = _probs([rows[i].params for i in rand_idx], logits[rand_idx])
    # Exponential race (argmax p / E, E ~ Exp(1)) == categorical sampling, and lets each
    # seeded row draw its noise from its own generator.
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rand_idx) if rows[i].params.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1],
                                      device=probs.device).exponential_()
    for j, i in enumerate(rand_idx):
        sp = rows[i].params
        if sp.seed is not None:
            g = torch.Generator(device=probs.device).manual_seed(
                sp.seed * _SEED_STRIDE + sp.sample_index_offset + rows[i].num_output_tokens)
            noise[j] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
    picked = (probs / noise).argmax(dim=-1).tolist()
    for j, i in enumerate(rand_idx):
        out[i] = picked[j]
    return out


def _suppress_stop_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    # min_tokens: EOS and stop token ids are not allowed before that many tokens exist.
    for i, r in enumerate(rows):
        sp = r.params
        if r.num_output_tokens < sp.min_tokens:
            banned = list(sp.stop_token_ids)
            if not sp.ignore_eos:
                banned += list(r.eos_token_ids)
            if banned:
                logits[i, banned] = float("-inf")


def _adjust_logits(logits: torch.Tensor, row: SampleRow) -> None:
    """logit_bias, then the repetition, frequency and presence penalties, on one row
    ``logits [vocab]`` in place."""
    sp = row.params
    dev = logits.device
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.int64, device=dev)
        logits.index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()),
                                                dtype=logits.dtype, device=dev))
    if sp.repetition_penalty == 1 and sp.frequency_penalty == 0 and sp.presence_penalty == 0:
        return
    generated = torch.tensor(row.generated_token_ids(), dtype=torch.int64, device=dev)
    if sp.repetition_penalty != 1:
        seen = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
        seen[generated] = True
        moved = sp.sample_index_offset
        prompt = row.prompt_token_ids[:len(row.prompt_token_ids) - moved]
        seen[torch.tensor(prompt, dtype=torch.int64, device=dev)] = True
        rp = sp.repetition_penalty
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / rp, logits[seen] * rp)
    if sp.frequency_penalty != 0 or sp.presence_penalty != 0:
        counts = torch.bincount(generated, minlength=logits.shape[0]).to(logits.dtype)
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[1]
        k_max = max(min(k, vocab) if k > 0 else vocab for k in top_ks)
        kth = torch.topk(logits, k_max, dim=-1).values  # [N, k_max], descending
        idx = torch.tensor([(min(k, vocab) if k > 0 else k_max) - 1 for k in top_ks],
                           device=dev).unsqueeze(1)
        thresh = kth.gather(1, idx)
        keep_all = torch.tensor([k <= 0 for k in top_ks], device=dev).unsqueeze(1)
        logits = logits.masked_fill(~keep_all & (logits < thresh), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        mp = torch.tensor(min_ps, dtype=probs.dtype, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        tp = torch.tensor(top_ps, dtype=probs.dtype, device=dev).unsqueeze(1)
        # Drop a token when the mass before it already reaches top_p (always keeps the first).
        drop_sorted = (cum - sorted_p) >= tp
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def logprobs_of(raw_logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each row's ``tokens[i]`` log-probability under ``raw_logits [N, vocab]``, its rank and
    the ``k`` most likely tokens (one log-softmax over the rows)."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen_lp = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1))
    ranks = ((logp > chosen_lp).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    return [TokenLogprob(t, chosen_lp[j, 0].item(), ranks[j],
                         tuple(zip(top_ids[j].tolist(), top_lp[j].tolist(), strict=True)))
            for j, t in enumerate(tokens)]


def token_logprobs(raw_logits: torch.Tensor, rows: list[SampleRow], tokens: list[int]
                   ) -> list[TokenLogprob | None]:
    """Each row's sampled token's log-probability under the model, from ``raw_logits [N,
    vocab]`` (before any adjustment), with its rank and the row's ``logprobs`` most likely
    tokens; None for rows that did not ask. One log-softmax over the rows that asked."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not asked:
        return out
    logp = torch.log_softmax(raw_logits[asked].float(), dim=-1)  # [A, vocab]
    chosen = torch.tensor([tokens[i] for i in asked], device=logp.device).unsqueeze(1)
    chosen_lp = logp.gather(1, chosen)  # [A, 1]
    ranks = ((logp > chosen_lp).sum(dim=-1) + 1).tolist()
    k_max = max(rows[i].params.logprobs for i in asked)
    top_lp, top_ids = (logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0]))
    for j, i in enumerate(asked):
        k = rows[i].params.logprobs
        top = tuple(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist(), strict=True))
        out[i] = TokenLogprob(tokens[i], chosen_lp[j, 0].item(), ranks[j], top)
    return out
