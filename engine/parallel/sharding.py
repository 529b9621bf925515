"""Megatron-style sharding of a Llama-family decoder over ``size`` ranks: what rank ``rank``
holds, and which rows or columns of each Hugging Face tensor that is.

- Q/K/V and gate/up are column-parallel, O and down row-parallel over the same ranges, so each
  layer needs one all-reduce after O and one after down.
- Attention is cut by KV-head group (a KV head and the query heads that read it), so a rank's
  query heads always find their KV heads on the same rank. With at least as many KV heads as
  ranks, rank r holds groups ``[r KVH / t, (r+1) KVH / t)`` (floored: an uneven split where
  ``t`` does not divide KVH, e.g. SmolLM2-135M's 3 KV heads over 2 ranks: 2 + 1). With fewer
  (``t % KVH == 0``), each KV head is replicated on ``t / KVH`` ranks, which split its group's
  query heads, as vLLM does. The KV cache a rank holds is that rank's KV heads only.
- The MLP's intermediate columns split as evenly as they go (floored ranges).
- The LM head is vocabulary-parallel (rows ``[r V', (r+1) V')``, ``V' = ceil(V / t)``; the
  last slice may be short); ranks all-gather their logits. The embedding and the norms are
  replicated (an embedding lookup is cheap; sharding it would cost one more all-reduce).

Pure (no torch.distributed): the engine and its tests read the same answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import cdiv
from engine.models.config import ModelConfig

__all__ = ["TPShard", "kv_head_range"]


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> range:
    """The model's KV heads rank ``rank`` of ``size`` holds: its share of them, or the one
    head its query heads read (replicated when there are fewer KV heads than ranks). Both
    ends of a KV transfer compute the other's with this (``kv_transfer.routes``)."""
    if num_kv_heads >= size:
        return range(num_kv_heads * rank // size, num_kv_heads * (rank + 1) // size)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of {self.size}: "
                             "needs size >= 1 and 0 <= rank < size")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the dimension that cannot be cut into ``size`` parts."""
        t, kvh = self.size, cfg.num_kv_heads
        problems = []
        if kvh < t and t % kvh:
            problems.append(f"{kvh} KV heads (fewer than the ranks, and not a divisor of them)")
        elif kvh < t and (cfg.num_heads // kvh) % (t // kvh):
            problems.append(f"{cfg.num_heads} attention heads ({cfg.num_heads // kvh} per KV "
                            f"head, shared by {t // kvh} ranks)")
        if cfg.intermediate_size < t:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if 0 < cfg.shared_expert_intermediate_size < t:
            problems.append(f"shared expert size {cfg.shared_expert_intermediate_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size={t} does not divide {cfg.model_id}'s "
                             f"{', '.join(problems)}")

    # ---- what this rank holds ----------------------------------------------------------------
    def _split(self, n: int, rank: int | None = None) -> range:
        r = self.rank if rank is None else rank
        return range(n * r // self.size, n * (r + 1) // self.size)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """This rank's KV heads: its share of them, or the one head its query heads read (KV
        heads replicated when there are fewer than ranks)."""
        return kv_head_range(cfg.num_kv_heads, self.rank, self.size)

    def q_heads(self, cfg: ModelConfig) -> range:
        """The query heads that read this rank's KV heads (a share of them when replicated)."""
        group = cfg.num_heads // cfg.num_kv_heads
        kv = self.kv_heads(cfg)
        if cfg.num_kv_heads >= self.size:
            return range(kv.start * group, kv.stop * group)
        replicas = self.size // cfg.num_kv_heads
        per = group // replicas
        first = kv.start * group + (self.rank % replicas) * per
        return range(first, first + per)

    def max_kv_heads(self, cfg: ModelConfig) -> int:
        """The most KV heads any rank holds (gathers pad every rank's to it)."""
        return max(len(TPShard(r, self.size).kv_heads(cfg)) for r in range(self.size))

    def intermediate(self, cfg: ModelConfig) -> range:
        return self._split(cfg.intermediate_size)

    def shared_intermediate(self, cfg: ModelConfig) -> range:
        """This rank's columns of a Qwen2-MoE shared expert (empty range: none)."""
        return self._split(cfg.shared_expert_intermediate_size)

    def vocab(self, cfg: ModelConfig) -> range:
        """This rank's rows of the LM head (the last slice may be short, or empty)."""
        per = cdiv(cfg.vocab_size, self.size)
        return range(min(self.rank * per, cfg.vocab_size),
                     min((self.rank + 1) * per, cfg.vocab_size))

    def vocab_per_rank(self, cfg: ModelConfig) -> int:
        return cdiv(cfg.vocab_size, self.size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The decoder layers' shapes on this rank (heads, KV heads, intermediate size):
        what the layers, the attention backend and the KV cache are built with. Hidden size,
        vocabulary and everything else stay the model's."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(cfg, num_heads=len(self.q_heads(cfg)),
                                   num_kv_heads=len(self.kv_heads(cfg)),
                                   intermediate_size=len(self.intermediate(cfg)),
                                   shared_expert_intermediate_size=len(self.shared_intermediate(cfg)))

    # ---- which part of each checkpoint tensor ----------------------------------------------
    def slice_of(self, name: str, cfg: ModelConfig) -> tuple | None:
        """``(dim, start, stop)`` of HF tensor ``name`` that this rank loads, or None when it
        loads the whole tensor (replicated, or a size-1 group). A fused checkpoint tensor
        (Phi-3's ``qkv_proj`` / ``gate_up_proj``) gives ``(dim, ((start, stop), ...))``: the
        rank's rows of each part, concatenated in that order."""
        if self.size == 1:
            return None
        d = cfg.head_dim
        q, kv, inter = self.q_heads(cfg), self.kv_heads(cfg), self.intermediate(cfg)
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        proj = leaf[0] if len(leaf) == 2 else ""
        if proj == "qkv_proj":
            h, kvh = cfg.num_heads * d, cfg.num_kv_heads * d
            return 0, ((q.start * d, q.stop * d), (h + kv.start * d, h + kv.stop * d),
                       (h + kvh + kv.start * d, h + kvh + kv.stop * d))
        if proj == "gate_up_proj":
            n = cfg.intermediate_size
            return 0, ((inter.start, inter.stop), (n + inter.start, n + inter.stop))
        if proj == "q_proj":
            return 0, q.start * d, q.stop * d
        if proj in ("k_proj", "v_proj"):
            return 0, kv.start * d, kv.stop * d
        if proj == "o_proj":
            return 1, q.start * d, q.stop * d
        if ".shared_expert." in name:  # cut like an MLP, by its own intermediate size
            inter = self.shared_intermediate(cfg)
        # Dense MLPs and every expert alike (Mixtral names its experts' w1 / w3 / w2).
        if proj in ("gate_proj", "up_proj", "w1", "w3"):
            return 0, inter.start, inter.stop
        if proj in ("down_proj", "w2"):
            return 1, inter.start, inter.stop
        if name == "lm_head.weight":
            v = self.vocab(cfg)
            return 0, v.start, v.stop
        return None
