"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
min_tokens, and the logit adjustments (logit_bias, repetition / frequency / presence penalties).

The order is vLLM's: stop tokens suppressed (min_tokens), logit_bias, penalties, then greedy
argmax or temperature -> min_p -> top-k -> top-p -> the draw. Rows that set none of the
adjustments pay nothing for them (one attribute test per row and step).

Bans are authoritative. A token whose logit is -inf when ``sample`` is called (a grammar's
mask, ``engine.executor.grammar_mask.mask_logits``) is never chosen, whatever the adjustments
do to the row: they are free to be degenerate (a repetition penalty of 5e-324 is 0 in fp32, so a seen
positive logit divides to +inf and a masked -inf one multiplies to nan; argmax takes nan for
the largest value). So after the adjustments each such row is made sane again: nan counts as
-inf, +inf as fp32's largest value (those tokens then win, uniformly among themselves when
sampled), and the caller's bans are re-imposed. Temperature divides logits already shifted to
a maximum of 0 (so a subnormal temperature cannot overflow them to inf - inf).

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

from engine.contract import SamplingParams, TokenLogprob

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
    """``logits [N, vocab]`` (fp32, finite but for -inf; adjusted in place) -> one token id
    per row.

    A token whose logit is -inf on entry (the caller's ban: a grammar's mask) is never
    chosen, whatever the row's penalties, bias or temperature: the rows changed here before
    the choice (min_tokens' ban, logit_bias, penalties) have their bans re-imposed after the
    changes, and temperature and the truncations keep -inf at probability 0. Where the changes
    leave every allowed token at -inf (or nan), the row picks among the allowed ones as if
    their logits were equal: the first greedily, uniformly when sampled."""
    # The bans of the rows about to change, before they do (a vocabulary-wide pass each,
    # ~15 us at 49k tokens); rows left as they came cannot lose theirs and skip it.
    banned = {i: torch.isneginf(logits[i]) for i, r in enumerate(rows)
              if r.params.adjusts_logits or r.num_output_tokens < r.params.min_tokens}
    _suppress_stop_tokens(logits, rows)
    for i, r in enumerate(rows):
        if r.params.adjusts_logits:
            _adjust_logits(logits[i], r)
    for i, ban in banned.items():
        _reimpose_bans(logits[i], ban)
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
    # A draw of exactly 0 would make a banned token's score 0 / 0 = nan, which argmax picks.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
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


def _reimpose_bans(logits: torch.Tensor, banned: torch.Tensor) -> None:
    """Make one adjusted row ``logits [vocab]`` sane again, in place: nan -> -inf, +inf ->
    fp32's largest value (still the row's winners, and finite: a later shift by the row's
    maximum cannot make inf - inf), the ``banned [vocab]`` tokens -inf again; and when no
    allowed token is left above -inf, every allowed one at 0 (equally likely)."""
    logits.nan_to_num_(nan=float("-inf"), neginf=float("-inf"))  # +inf: the largest finite
    logits.masked_fill_(banned, float("-inf"))
    if bool(torch.isneginf(logits.amax())):
        logits.masked_fill_(~banned, 0.0)


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
    """Each row's sampling distribution ``[R, vocab]``: temperature, top-k, min-p, top-p.
    Every row keeps its most likely token (probability > 0) and a -inf logit stays 0."""
    dev = logits.device
    # fp32 rounds a temperature under ~1e-45 to 0 (then x / 0 is inf and 0 / 0 nan): floor it
    # at the smallest normal value, which still sends every logit below the maximum to -inf.
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                         device=dev).clamp_min_(torch.finfo(logits.dtype).tiny).unsqueeze(1)
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    if not bool(torch.isfinite(top).all()):
        # Only a row ``sample`` left as it came can get here: a broken model's nan or +inf.
        # nan -> -inf, +inf -> the largest finite; a row with nothing left above -inf is
        # drawn from the whole vocabulary (its bans are not known here).
        logits = logits.nan_to_num(nan=float("-inf"), neginf=float("-inf"))
        dead = torch.isneginf(logits.amax(dim=-1, keepdim=True))
        logits = logits.masked_fill(dead, 0.0)
        top = logits.amax(dim=-1, keepdim=True)
    # Shifted to a maximum of 0 before dividing: a tiny temperature sends the others to -inf
    # (never inf), a huge one flattens them; softmax itself is unchanged by the shift.
    logits = (logits - top).div_(temps)
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
        # Drop a token when the mass before it already reaches top_p; never the first (a
        # top_p under ~1e-45 is 0 in fp32, and the mass before the first, 0, reaches it).
        drop_sorted = (cum - sorted_p) >= tp
        drop_sorted[:, 0] = False
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
