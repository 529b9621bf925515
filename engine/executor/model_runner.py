"""Runs one scheduled step: the model over the paged KV cache, then sampling.

Owns the KV cache tensors (one ``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer;
read and written as whole-model layers through ``rank_kv``, ``engine.executor.rank_kv``), the
model weights and the attention backend. Each step it builds one ``AttentionMetadata``
(``engine.executor.step_inputs``) and plans the backend once; every layer then reuses that plan.

Decode-only steps may be padded to a batch-size bucket (``engine.executor.cuda_graphs``): on CUDA with
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
    row_width,
    storage_dtype,
)
from engine.attention.factory import create_backend
from engine.config import CacheConfig, cdiv
from engine.core.scheduler import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from engine.executor.cuda_graphs import CudaGraphRunner, DecodePadding, decode_buckets
from engine.executor.fused_decode import FusedDecodePlan
from engine.executor.grammar_mask import mask_logits
from engine.executor.kv_pages import zeroed_kv_pages
from engine.executor.pooling import pool_parts
from engine.executor.rank_kv import KVRead, RankKV, ShardExport
from engine.executor.sampling import SampleRow, logprobs_of, sample, token_logprobs
from engine.executor.step_inputs import PromptLogits, StepInputs, prepare_step, prompt_logit_plan
from engine.executor.verify import verified_output
from engine.lora.rows import LoRARows
from engine.lora.rows import active as active_lora
from engine.lora.rows import using as using_lora
from engine.models.config import ModelConfig
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.ops.linear import exact_activations, plan_rows

log = logging.getLogger(__name__)
_logged_torch_graphs_off = False  # log that once per process, not once per engine


@dataclass(frozen=True)
class FollowerStep:
    """What rank 0 sends the other tensor-parallel ranks for one step (no grammars, no
    sampling parameters: they only run the forward and the logits)."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    prompt_plan: list[PromptLogits]
    sample_rows: list[int]
    # KV rank 0's layer hook reads after each layer (request id, block ids, tokens, start),
    # in its order.
    kv_reads: list[KVRead]
    # True: each rank reads its own heads and hands them to its rank agent (KV leaves every
    # rank on its own routes); False: the ranks all-gather the heads for rank 0.
    kv_shards: bool = False
    exact: bool = False  # rank 0's StepInputs.has_prompt_rows (exact_activations)
    batch: int | None = None  # rank 0's plan_rows (drafts being verified)
    # the step's chunks as (LoRA adapter or None, tokens), in batch order (LoRARows.layout):
    # each rank adds its own shard of the adapters' products; None: no adapter in the step
    lora: tuple | None = None


def _sample_rows_apart(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow],
                       chunk_of_row: list[int]) -> tuple[list[int | None], list]:
    """Sample each row on its own: a row that raises fails its chunk only (validation should
    have refused it; this keeps a missed case from stopping the whole batch). ``logits``: as
    the sampler takes them (grammar masks applied); ``raw``: the model's. Returns each row's
    token (None: failed) and logprob, and the failed chunks' reasons by chunk index."""
    tokens: list[int | None] = []
    lps: list = []
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            token = sample(logits[i:i + 1].clone(), [row])[0]
            lps.append(token_logprobs(raw[i:i + 1], [row], [token])[0])
            tokens.append(token)
        except Exception as e:
            failed.setdefault(chunk_of_row[i], f"sampling failed: {type(e).__name__}: {e}")
            tokens.append(None)
            lps.append(None)
    return tokens, [lps, failed]


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
        self.cfg = cfg  # this rank's shapes under tensor parallelism
        self.tp = model.comm  # None: one rank
        # The engine's LoRA adapters (engine.lora.registry), None when LoRA is off.
        self.lora = None
        if self.tp is not None and cuda_graphs:
            # A captured graph would need the NCCL collectives captured with it; not yet.
            log.info("CUDA graphs off under tensor parallelism")
            cuda_graphs = False
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        dtype = getattr(torch, cfg.dtype)
        self.device = model.embed.weight.device  # the model is already where it will run
        self.attn_backend = create_backend(
            attention_backend, self.device,
            AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype,
                           tuple(cfg.layer_windows) if cfg.sliding_window else (),
                           cfg.attn_softcap, cache_config.kv_cache_dtype))
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
        # The pool's format (engine.attention.kv_format): the model's dtype, or int8 rows
        # with their scales, one row of head_dim + 4 bytes per token and KV head.
        self.kv_cache_dtype = cache_config.kv_cache_dtype
        shape = (num_pages, 2, self.block_size, cfg.num_kv_heads,
                 row_width(cfg.head_dim, self.kv_cache_dtype))
        self.kv_caches = [zeroed_kv_pages(shape, storage_dtype(self.kv_cache_dtype, dtype),
                                          self.device)
                          for _ in range(cfg.num_layers)]
        # KV in and out as whole-model layers; under tensor parallelism, rank 0's messages
        # to the other ranks and the pages they hold for arriving KV.
        self.rank_kv = RankKV(self.kv_caches, self.block_size, self.device, model)
        self.eos_token_ids = cfg.eos_token_ids
        # Where pure-decode steps run as one C call (the engine sets the host's timed choice:
        # engine.tuning.fused_decode.tune_fused_decode); untuned: never.
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
        return prepare_step(sched, self.block_size, self.decode_padding if allow_padding else None)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 layer_hook: LayerHook | None = None, batch: int | None = None) -> torch.Tensor:
        """Plan the backend once for the step, then run every layer: ``[T, hidden]``. A
        pure-decode step at a batch where the host timed it faster runs as one fused call.
        ``batch``: the step's sequences when its rows are more (drafts being verified): the
        fused call then runs the tiles a decode step of those sequences runs, so every row
        gets a plain decode row's arithmetic (the same tokens as without speculation)."""
        dev = self.device
        b = batch or meta.num_seqs
        if (layer_hook is None and self.tp is None and meta.num_decode == meta.num_seqs
                and self.fused_decode.use(b) and self.attn_backend.whole_step_decode):
            hidden = self.model.decode_fused(input_ids, meta.positions, self.kv_caches,
                                             *self.attn_backend.decode_tables(meta), self.block_size,
                                             self.fused_decode.wide_from(b),
                                             self.fused_decode.int_products(b),
                                             self.fused_decode.amx_tiles(b),
                                             panels=self.fused_decode.panels(b),
                                             lora=active_lora())
            if hidden is not None:
                return hidden
        self.attn_backend.plan(meta)
        return self.model(input_ids.to(dev, non_blocking=True),
                          meta.positions.to(dev, non_blocking=True), self.kv_caches, self.attn_backend,
                          layer_hook)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, layer_hook: LayerHook | None = None,
                kv_reads: list[KVRead] = (), kv_shards: bool = False) -> ModelRunnerOutput:
        """Run one step; returns the sampled token of every chunk with ``sample=True``.
        Under tensor parallelism (rank 0) the step goes to the other ranks first, which run
        the same forward and logits (``follow_step``); rank 0 alone samples. ``kv_reads``:
        the ``read_layer_kv`` calls ``layer_hook`` makes after each layer (request id, block
        ids, tokens, start), in order: the other ranks make them too (``kv_shards``: each
        its own heads, no gather)."""
        if sched.is_empty:
            return ModelRunnerOutput()
        # A layer hook (KV export) must run between layers: never inside a replayed graph.
        inp = self.prepare(sched, allow_padding=layer_hook is None)
        # a step with prompt rows multiplies fp32 activations, logits included
        # (engine.ops.linear.exact_activations)
        # rows under LoRA adapters: the decoder's projections add theirs (engine.lora.rows)
        lora = LoRARows.of(inp.order, self.lora.get) if self.lora is not None else None
        with exact_activations(inp.has_prompt_rows), using_lora(lora):
            return self._execute_prepared(inp, layer_hook, kv_reads, kv_shards)

    def _execute_prepared(self, inp: StepInputs, layer_hook: LayerHook | None,
                          kv_reads: list[KVRead], kv_shards: bool) -> ModelRunnerOutput:
        prompt_plan = prompt_logit_plan(inp)
        # Drafts being verified (more sampled rows than chunks): every kernel takes the path
        # a decode step of the chunks' sequences takes (``_forward``, ``plan_rows``), so each
        # row gets a plain decode row's arithmetic.
        batch = len(inp.order) if len(inp.sample_rows) > len(inp.sample_chunks) else None
        if self.tp is not None:
            self.rank_kv.broadcast(("step", FollowerStep(
                inp.input_ids, inp.meta, prompt_plan, inp.sample_rows,
                list(kv_reads) if layer_hook is not None else [], kv_shards,
                inp.has_prompt_rows, batch,
                LoRARows.layout(inp.order) if self.lora is not None else None)))
        with plan_rows(batch):
            if inp.bucket is not None and self.graph_runner is not None:
                hidden = self.graph_runner.run(inp.input_ids, inp.meta)
            else:
                hidden = self._forward(inp.input_ids, inp.meta, layer_hook, batch)
            prompt_lps = self._prompt_logprobs(prompt_plan, hidden)
            pooled = pool_parts(inp, hidden) if inp.has_pooling else {}
            if not inp.sample_rows:
                return ModelRunnerOutput(prompt_logprobs=prompt_lps, pooled=pooled)
            logits = self.model.compute_logits(hidden[inp.sample_rows])
        out = self._sample(logits, inp.sample_chunks, prompt_lps)
        out.pooled = pooled
        return out

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                prompt_lps: dict[str, tuple[int, list]]) -> ModelRunnerOutput:
        """Sample every row of ``logits`` (one per sampled chunk, and a verifying chunk's
        ``num_draft + 1``: its last token's and each draft's, each sampled as if the drafts
        before it had been generated) and keep each verifying chunk's drafts up to the first
        its own row's token disagrees with (engine.spec.verify)."""
        rows: list[SampleRow] = []
        chunk_of_row: list[int] = []
        grammar_rows, states, advance = [], [], []
        for ci, c in enumerate(chunks):
            drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else []
            for i in range(c.num_draft + 1):
                out_ids = (c.output_token_ids if not i or not c.sampling_params.adjusts_logits
                           else [*c.output_token_ids, *drafts[:i]])
                rows.append(SampleRow(c.sampling_params, c.num_output_tokens + i,
                                      self.eos_token_ids, c.prompt_token_ids, out_ids))
                if c.grammar is not None:
                    grammar_rows.append(len(chunk_of_row))
                    states.append(c.grammar)
                    advance.append(drafts[i] if i < len(drafts) else None)
                chunk_of_row.append(ci)
        # The sampler adjusts logits in place; logprobs describe the model's own.
        raw = logits.clone() if any(r.params.logprobs is not None for r in rows) else None
        if grammar_rows:
            mask_logits(logits, grammar_rows, states, advance)
        try:
            tokens = sample(logits, rows)
            lps = (token_logprobs(raw, rows, tokens) if raw is not None
                   else [None] * len(tokens))
            failed: dict[int, str] = {}
        except Exception:  # one row's parameters broke the batch: find it, fail it alone
            base = raw.clone() if raw is not None else logits  # masked ones stay -inf
            if raw is not None and grammar_rows:  # the states are back: the same masks
                mask_logits(base, grammar_rows, states, advance)
            tokens, (lps, failed) = _sample_rows_apart(base, raw if raw is not None else base,
                                                       rows, chunk_of_row)
        return verified_output(chunks, tokens, lps, failed, prompt_lps)

    def _prompt_logprobs(self, plan: list[PromptLogits], hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list]]:
        """Request id -> (first position it describes, each position's logprobs)."""
        out: dict[str, tuple[int, list]] = {}
        for p in plan:
            lps = []
            for r0, r1, targets in p.slices:
                lps += logprobs_of(self.model.compute_logits(hidden[r0:r1]), targets, p.k)
            out[p.request_id] = (p.first_pos, lps)
        return out

    # ---- tensor parallelism: what the other ranks run ------------------------------------
    @torch.inference_mode()
    def follow_step(self, step: FollowerStep, export: ShardExport | None = None) -> None:
        """Rank > 0's share of rank 0's ``execute``: the same forward and logits, in the
        same order (the collectives inside meet rank 0's); nothing sampled. With
        ``step.kv_shards`` each read's own heads go to ``export`` (the rank's agent)."""
        def read_kv(layer: int, _cache: torch.Tensor) -> None:
            for rid, block_ids, num_tokens, start in step.kv_reads:
                kv = self.rank_kv.read_layer_kv(layer, block_ids, num_tokens, start,
                                                gather=not step.kv_shards)
                if step.kv_shards and export is not None:
                    export(rid, layer, kv, self.rank_kv.own_kv_heads)

        if step.lora is not None and self.lora is None:
            raise RuntimeError("rank 0 sent a step under LoRA adapters; this rank holds none")
        lora = LoRARows.of_layout(step.lora, self.lora.get) if step.lora is not None else None
        with exact_activations(step.exact), plan_rows(step.batch), using_lora(lora):  # rank 0's
            hidden = self._forward(step.input_ids, step.meta,
                                   read_kv if step.kv_reads else None)
            for p in step.prompt_plan:
                for r0, r1, _ in p.slices:
                    self.model.compute_logits(hidden[r0:r1])
            if step.sample_rows:
                self.model.compute_logits(hidden[step.sample_rows])

    @torch.inference_mode()
    def follow_prompt_logits(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Rank > 0's share of ``compute_logits_for_prompt``."""
        meta = build_metadata([SeqSlice(block_ids, 0, len(token_ids))], self.block_size)
        with exact_activations():  # a prompt, as rank 0's
            self.model.compute_logits(self._forward(torch.tensor(token_ids, dtype=torch.int64),
                                                    meta))

    @torch.inference_mode()
    def compute_logits_for_prompt(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Full-prompt logits ``[T, vocab]`` (tests compare them with transformers)."""
        if self.tp is not None:
            self.rank_kv.broadcast(("prompt_logits", token_ids, block_ids))
        meta = build_metadata([SeqSlice(block_ids, 0, len(token_ids))], self.block_size)
        with exact_activations():  # a prompt (execute's rule)
            hidden = self._forward(torch.tensor(token_ids, dtype=torch.int64), meta)
            return self.model.compute_logits(hidden)
