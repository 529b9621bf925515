"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

Owns the KV cache tensors (one ``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer),
the model weights and the attention backend. Each step it builds one ``AttentionMetadata`` and
plans the backend once; every layer then reuses that plan. Chunks are laid out decode-first so
all single-token queries share one batched attention call.

Decode-only steps may be padded to a batch-size bucket (``engine.cuda_graphs``): on CUDA with
the FlashInfer backend they replay a captured CUDA graph; elsewhere padding is off unless a
test asks for it (``pad_decode_batches=True`` runs the padded batch eagerly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.backend import (
    AttentionMetadata,
    AttentionShape,
    SeqSlice,
    build_metadata,
)
from engine.attention.factory import create_backend
from engine.attention.torch_paged import TorchPagedBackend, decode_tables, gather_kv
from engine.config import CacheConfig, ModelConfig, cdiv
from engine.cuda_graphs import PAD_TOKEN_ID, CudaGraphRunner, DecodePadding, decode_buckets
from engine.fused_decode import FusedDecodePlan
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.sampling import SampleRow, logprobs_of, sample, token_logprobs
from engine.scheduler import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from engine.structured import mask_logits

log = logging.getLogger(__name__)
_PROMPT_LOGITS_ROWS = 256  # prompt-logprob logits per slice: 256 x a 49k vocabulary = 50 MB
_logged_torch_graphs_off = False  # log that once per process, not once per engine


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (padded rows included)
    meta: AttentionMetadata  # on the host; meta.positions: [T]
    order: list[ScheduledChunk]  # chunks in batch order
    sample_rows: list[int]  # hidden-state row of each sampled chunk's last token
    sample_chunks: list[ScheduledChunk]
    # Decode-only step padded to this many sequences (dummies after the real ones); None: eager.
    bucket: int | None = None


def _sample_rows_apart(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow],
                       chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
    """Sample each row on its own: the rows that raise fail their request only (validation
    should have refused them; this keeps a missed case from stopping the whole batch).
    ``logits``: as the sampler takes them (grammar masks applied); ``raw``: the model's."""
    out = ModelRunnerOutput()
    for i, (row, chunk) in enumerate(zip(rows, chunks, strict=True)):
        try:
            token = sample(logits[i:i + 1].clone(), [row])[0]
            out.sampled_token_ids[chunk.request_id] = token
            lp = token_logprobs(raw[i:i + 1], [row], [token])[0]
            if lp is not None:
                out.logprobs[chunk.request_id] = lp
        except Exception as e:
            out.failed[chunk.request_id] = f"sampling failed: {type(e).__name__}: {e}"
    return out


class ModelRunner:
    """Executes scheduled steps. Not thread-safe: one engine loop drives it.

    ``num_blocks`` is what the block manager hands out. With decode padding on (CUDA graphs
    running, or ``pad_decode_batches=True``) the KV caches hold ``num_blocks + 1`` pages: page
    ``num_blocks`` is the scratch page padded rows write to, which no request ever gets.
    CUDA graphs run only with the FlashInfer backend (the torch backend's plan has
    data-dependent shapes); they are captured here, for buckets up to ``max_num_seqs``, with
    room for ``max_model_len`` tokens per sequence (default: the model's context).
    """

    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig, num_blocks: int,
                 attention_backend: str = "torch", cuda_graphs: bool = False,
                 max_num_seqs: int = 32, max_model_len: int | None = None,
                 pad_decode_batches: bool | None = None) -> None:
        global _logged_torch_graphs_off
        cfg: ModelConfig = model.cfg
        self.model = model
        self.cfg = cfg
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        dtype = getattr(torch, cfg.dtype)
        self.device = model.embed.weight.device  # the model is already where it will run
        self.attn_backend = create_backend(
            attention_backend, self.device,
            AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype))
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device (the model is on {self.device})")
        if cuda_graphs and attention_backend != "flashinfer":
            if not _logged_torch_graphs_off:
                log.info("CUDA graphs off: the %r attention backend plans data-dependent shapes "
                         "each step; they need the flashinfer backend", attention_backend)
                _logged_torch_graphs_off = True
            cuda_graphs = False
        self.use_cuda_graphs = cuda_graphs
        pad = cuda_graphs if pad_decode_batches is None else pad_decode_batches
        self.decode_padding = (DecodePadding(decode_buckets(max_num_seqs), scratch_page=num_blocks)
                               if pad else None)
        num_pages = num_blocks + 1 if pad else num_blocks
        shape = (num_pages, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(cfg.num_layers)]
        self.eos_token_ids = cfg.eos_token_ids
        # Where pure-decode steps run as one C call (the engine sets the host's timed choice:
        # engine.fused_decode.tune_fused_decode); untuned: never.
        self.fused_decode = FusedDecodePlan()
        self.graph_runner: CudaGraphRunner | None = None
        if cuda_graphs:
            assert self.decode_padding is not None
            max_pages = cdiv(max_model_len or cfg.max_model_len, self.block_size)
            self.graph_runner = CudaGraphRunner(model, self.kv_caches, self.attn_backend,
                                                self.decode_padding, self.block_size, max_pages)
            self.graph_runner.capture()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def prepare(self, sched: SchedulerOutput, allow_padding: bool = True) -> StepInputs:
        """The step's tensors, decode-first; a decode-only step is padded to its bucket when
        decode padding is on and ``allow_padding``."""
        decodes = [c for c in sched.chunks if c.num_tokens == 1]
        prefills = [c for c in sched.chunks if c.num_tokens > 1]
        order = decodes + prefills
        ids: list[int] = []
        for c in order:
            ids.extend(c.token_ids)
        seqs = [SeqSlice(c.block_ids, c.start_pos, c.num_tokens) for c in order]
        bucket = None
        if self.decode_padding is not None and allow_padding:
            bucket = self.decode_padding.bucket_for(seqs)
            if bucket is not None:
                seqs = self.decode_padding.pad(seqs, bucket)
                ids.extend([PAD_TOKEN_ID] * (bucket - len(order)))
        meta = build_metadata(seqs, self.block_size)
        sample_rows, sample_chunks = [], []
        row = 0
        for c in order:
            row += c.num_tokens
            if c.sample:
                sample_rows.append(row - 1)
                sample_chunks.append(c)
        return StepInputs(torch.tensor(ids, dtype=torch.int64), meta, order, sample_rows,
                          sample_chunks, bucket)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Plan the backend once for the step, then run every layer: ``[T, hidden]``. A
        pure-decode step at a batch where the host timed it faster runs as one fused call."""
        dev = self.device
        if (layer_hook is None and meta.num_decode == meta.num_seqs
                and self.fused_decode.use(meta.num_seqs)
                and isinstance(self.attn_backend, TorchPagedBackend)):
            hidden = self.model.decode_fused(input_ids, meta.positions, self.kv_caches,
                                             *decode_tables(meta), self.block_size,
                                             self.fused_decode.wide_from(meta.num_seqs))
            if hidden is not None:
                return hidden
        self.attn_backend.plan(meta)
        return self.model(input_ids.to(dev, non_blocking=True),
                          meta.positions.to(dev, non_blocking=True), self.kv_caches, self.attn_backend,
                          layer_hook)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, layer_hook: LayerHook | None = None) -> ModelRunnerOutput:
        """Run one step; returns the sampled token of every chunk with ``sample=True``."""
        if sched.is_empty:
            return ModelRunnerOutput()
        # A layer hook (KV export) must run between layers: never inside a replayed graph.
        inp = self.prepare(sched, allow_padding=layer_hook is None)
        if inp.bucket is not None and self.graph_runner is not None:
            hidden = self.graph_runner.run(inp.input_ids, inp.meta)
        else:
            hidden = self._forward(inp.input_ids, inp.meta, layer_hook)
        prompt_lps = self._prompt_logprobs(inp, hidden)
        if not inp.sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt_lps)
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        rows = [SampleRow(c.sampling_params, c.num_output_tokens, self.eos_token_ids,
                          c.prompt_token_ids, c.output_token_ids)
                for c in inp.sample_chunks]
        # The sampler adjusts logits in place; logprobs describe the model's own.
        raw = logits.clone() if any(r.params.logprobs is not None for r in rows) else None
        constrained = [i for i, c in enumerate(inp.sample_chunks) if c.grammar is not None]
        states = [inp.sample_chunks[i].grammar for i in constrained]
        if constrained:
            mask_logits(logits, constrained, states)
        try:
            tokens = sample(logits, rows)
        except Exception:  # one row's parameters broke the batch: find it, fail it alone
            if raw is None:  # what the sampler left (masked tokens stay -inf through it)
                return _sample_rows_apart(logits, logits, rows, inp.sample_chunks)
            base = raw.clone()
            if constrained:  # the states did not move: the same masks again
                mask_logits(base, constrained, states)
            return _sample_rows_apart(base, raw, rows, inp.sample_chunks)
        out = ModelRunnerOutput({c.request_id: t
                                 for c, t in zip(inp.sample_chunks, tokens, strict=True)},
                                prompt_logprobs=prompt_lps)
        if raw is not None:
            for c, lp in zip(inp.sample_chunks, token_logprobs(raw, rows, tokens), strict=True):
                if lp is not None:
                    out.logprobs[c.request_id] = lp
        return out

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list]]:
        """For each chunk whose request asked for prompt logprobs: each of its positions'
        next prompt token's log-probability (request id -> (first position it describes,
        logprobs)). Logits are computed a slice of rows at a time: a whole long prompt's
        would be rows x vocabulary floats at once."""
        out: dict[str, tuple[int, list]] = {}
        row = 0
        for c in inp.order:
            k = c.sampling_params.prompt_logprobs
            if k is None:
                row += c.num_tokens
                continue
            last = min(c.end_pos, len(c.prompt_token_ids) - 1)  # positions with a next token
            if c.start_pos < last:
                lps = []
                for p0 in range(c.start_pos, last, _PROMPT_LOGITS_ROWS):
                    p1 = min(p0 + _PROMPT_LOGITS_ROWS, last)
                    r0 = row + p0 - c.start_pos
                    logits = self.model.compute_logits(hidden[r0:r0 + p1 - p0])
                    lps += logprobs_of(logits, list(c.prompt_token_ids[p0 + 1:p1 + 1]), k)
                out[c.request_id] = (c.start_pos + 1, lps)
            row += c.num_tokens
        return out

    @torch.inference_mode()
    def compute_logits_for_prompt(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Full-prompt logits ``[T, vocab]`` (tests compare them with transformers)."""
        meta = build_metadata([SeqSlice(block_ids, 0, len(token_ids))], self.block_size)
        hidden = self._forward(torch.tensor(token_ids, dtype=torch.int64), meta)
        return self.model.compute_logits(hidden)

    # ---- KV import/export (disaggregation) ------------------------------------------------
    def read_layer_kv(self, layer: int, block_ids: list[int], num_tokens: int,
                      start: int = 0) -> torch.Tensor:
        """One layer's KV of a request's positions ``[start, num_tokens)``, token-contiguous:
        ``[2, num_tokens - start, kv_heads, head_dim]``."""
        bs = self.block_size
        first, nb = start // bs, cdiv(num_tokens, bs)
        # Gather only the pages that hold [start, num_tokens), then drop the rows before start.
        k, v = gather_kv(self.kv_caches[layer],
                         torch.tensor(block_ids[first:nb], device=self.device),
                         num_tokens - first * bs)
        skip = start - first * bs
        return torch.stack([k[skip:], v[skip:]]) if skip else torch.stack([k, v])

    def write_layer_kv(self, layer: int, block_ids: list[int], kv: torch.Tensor,
                       start: int = 0) -> None:
        """Scatter ``[2, num_tokens, kv_heads, head_dim]`` into this runner's own pages at
        positions ``[start, start + num_tokens)``."""
        n = kv.shape[1]
        bs = self.block_size
        pos = torch.arange(start, start + n, device=self.device)
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.device)[pos // bs]
        cache = self.kv_caches[layer]
        cache[blocks, 0, pos % bs] = kv[0].to(cache.device, cache.dtype)
        cache[blocks, 1, pos % bs] = kv[1].to(cache.device, cache.dtype)
