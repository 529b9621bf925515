"""Megatron-style sharding of a Llama-family decoder over ``size`` ranks: what rank ``rank``
holds, and which rows or columns of each Hugging Face tensor that is.

- Q/K/V and gate/up are column-parallel: rank r holds query heads ``[r H/t, (r+1) H/t)`` and
  intermediate columns ``[r I/t, (r+1) I/t)``; O and down are row-parallel over the same
  ranges, so each layer needs one all-reduce after O and one after down.
- KV heads follow the query heads they serve. With fewer KV heads than ranks (``t > KVH``,
  ``t % KVH == 0``) each rank holds the one KV head its query heads read: replicated on
  ``t / KVH`` ranks, as vLLM does. The KV cache a rank holds is that rank's KV heads only.
- The LM head is vocabulary-parallel (rows ``[r V', (r+1) V')``, ``V' = ceil(V / t)``; the
  last slice may be short); ranks all-gather their logits. The embedding and the norms are
  replicated (an embedding lookup is cheap; sharding it would cost one more all-reduce).

Pure (no torch.distributed): the engine and its tests read the same answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import ModelConfig, cdiv

__all__ = ["TPShard"]


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
        """Raise ValueError naming the dimension that ``size`` does not divide."""
        t = self.size
        problems = []
        if cfg.num_heads % t:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.intermediate_size % t:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if cfg.num_kv_heads % t and t % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
        if problems:
            raise ValueError(f"tensor_parallel_size={t} does not divide {cfg.model_id}'s "
                             f"{', '.join(problems)}")

    # ---- what this rank holds ----------------------------------------------------------------
    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """This rank's KV heads: its own slice, or the one head its query heads read (KV
        heads replicated when there are fewer than ranks)."""
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank * cfg.num_kv_heads // self.size
        return range(head, head + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        per = cfg.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

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
                                   intermediate_size=len(self.intermediate(cfg)))

    # ---- which part of each checkpoint tensor ----------------------------------------------
    def slice_of(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of HF tensor ``name`` that this rank loads, or None when it
        loads the whole tensor (replicated, or a size-1 group)."""
        if self.size == 1:
            return None
        d = cfg.head_dim
        q, kv, inter = self.q_heads(cfg), self.kv_heads(cfg), self.intermediate(cfg)
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        proj = leaf[0] if len(leaf) == 2 else ""
        if proj == "q_proj":
            return 0, q.start * d, q.stop * d
        if proj in ("k_proj", "v_proj"):
            return 0, kv.start * d, kv.stop * d
        if proj == "o_proj":
            return 1, q.start * d, q.stop * d
        if proj in ("gate_proj", "up_proj"):
            return 0, inter.start, inter.stop
        if proj == "down_proj":
            return 1, inter.start, inter.stop
        if name == "lm_head.weight":
            v = self.vocab(cfg)
            return 0, v.start, v.stop
        return None
