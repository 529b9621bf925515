"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

Owns the KV cache tensors (one ``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer)
and the model weights. Chunks are laid out decode-first so all single-token queries share one
batched attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.torch_paged import (
    AttentionMetadata,
    PrefillSeq,
    build_decode_tables,
    gather_kv,
)
from engine.config import CacheConfig, ModelConfig
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.sampling import SampleRow, sample
from engine.scheduler import ModelRunnerOutput, ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    order: list[ScheduledChunk]  # chunks in batch order
    sample_rows: list[int]  # hidden-state row of each sampled chunk's last token
    sample_chunks: list[ScheduledChunk]


class ModelRunner:
    """Executes scheduled steps. Not thread-safe: one engine loop drives it."""

    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig, num_blocks: int) -> None:
        cfg: ModelConfig = model.cfg
        self.model = model
        self.cfg = cfg
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        dtype = getattr(torch, cfg.dtype)
        self.device = model.embed.weight.device  # the model is already where it will run
        shape = (num_blocks, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(cfg.num_layers)]
        self.eos_token_ids = cfg.eos_token_ids

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        decodes = [c for c in sched.chunks if c.num_tokens == 1]
        prefills = [c for c in sched.chunks if c.num_tokens > 1]
        order = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        for c in order:
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.end_pos))
        positions = torch.tensor(pos, dtype=torch.int64)
        # block of each new token = block_table[pos // bs]; flattened per chunk for one index op
        tables = torch.tensor([c.block_ids[p // bs] for c in order for p in range(c.start_pos, c.end_pos)],
                              dtype=torch.int64)
        meta = AttentionMetadata(slot_blocks=tables, slot_offsets=positions % bs, num_decode=len(decodes))
        if decodes:
            meta.decode_block_tables, meta.decode_key_mask = build_decode_tables(
                [c.block_ids for c in decodes], [c.end_pos for c in decodes], bs)
        q_start = len(decodes)
        for c in prefills:
            nb = -(-c.end_pos // bs)
            meta.prefills.append(PrefillSeq(q_start, c.num_tokens, c.start_pos,
                                            torch.tensor(c.block_ids[:nb], dtype=torch.int64)))
            q_start += c.num_tokens
        sample_rows, sample_chunks = [], []
        row = 0
        for c in order:
            row += c.num_tokens
            if c.sample:
                sample_rows.append(row - 1)
                sample_chunks.append(c)
        return StepInputs(torch.tensor(ids, dtype=torch.int64), positions, meta, order,
                          sample_rows, sample_chunks)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, layer_hook: LayerHook | None = None) -> ModelRunnerOutput:
        """Run one step; returns the sampled token of every chunk with ``sample=True``."""
        if sched.is_empty:
            return ModelRunnerOutput()
        inp = self.prepare(sched)
        dev = self.device
        hidden = self.model(inp.input_ids.to(dev, non_blocking=True),
                            inp.positions.to(dev, non_blocking=True), self.kv_caches,
                            inp.meta.to(dev), layer_hook)
        if not inp.sample_rows:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        rows = [SampleRow(c.sampling_params, c.num_output_tokens, self.eos_token_ids)
                for c in inp.sample_chunks]
        tokens = sample(logits, rows)
        return ModelRunnerOutput({c.request_id: t for c, t in zip(inp.sample_chunks, tokens, strict=True)})

    @torch.inference_mode()
    def compute_logits_for_prompt(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Full-prompt logits ``[T, vocab]`` (tests compare them with transformers)."""
        t = len(token_ids)
        nb = -(-t // self.block_size)
        positions = torch.arange(t)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor([block_ids[p // self.block_size] for p in range(t)]),
            slot_offsets=positions % self.block_size,
            prefills=[PrefillSeq(0, t, 0, torch.tensor(block_ids[:nb]))],
        )
        dev = self.device
        hidden = self.model(torch.tensor(token_ids, device=dev), positions.to(dev), self.kv_caches,
                            meta.to(dev))
        return self.model.compute_logits(hidden)

    # ---- KV import/export (disaggregation) ------------------------------------------------
    def read_layer_kv(self, layer: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """One layer's KV of a request, token-contiguous: ``[2, num_tokens, kv_heads, head_dim]``."""
        nb = -(-num_tokens // self.block_size)
        k, v = gather_kv(self.kv_caches[layer], torch.tensor(block_ids[:nb], device=self.device),
                         num_tokens)
        return torch.stack([k, v])

    def write_layer_kv(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Scatter ``[2, num_tokens, kv_heads, head_dim]`` into this runner's own pages."""
        n = kv.shape[1]
        bs = self.block_size
        pos = torch.arange(n, device=self.device)
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.device)[pos // bs]
        cache = self.kv_caches[layer]
        cache[blocks, 0, pos % bs] = kv[0].to(cache.device, cache.dtype)
        cache[blocks, 1, pos % bs] = kv[1].to(cache.device, cache.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        for cache in self.kv_caches:
            cache[dst].copy_(cache[src])
