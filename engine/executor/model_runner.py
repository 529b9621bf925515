"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

Owns the KV cache tensors (one ``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer),
the model weights and the attention backend. Each step it builds one ``AttentionMetadata`` and
plans the backend once; every layer then reuses that plan. Chunks are laid out decode-first so
all single-token queries share one batched attention call.

Decode-only steps may be padded to a batch-size bucket (``engine.executor.cuda_graphs``): on CUDA with
the FlashInfer backend they replay a captured CUDA graph; elsewhere padding is off unless a
test asks for it (``pad_decode_batches=True`` runs the padded batch eagerly).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
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
from engine.core.scheduler import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from engine.core.structured import mask_logits
from engine.executor.cuda_graphs import PAD_TOKEN_ID, CudaGraphRunner, DecodePadding, decode_buckets
from engine.executor.fused_decode import FusedDecodePlan
from engine.executor.sampling import SampleRow, logprobs_of, sample, token_logprobs
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.parallel.sharding import TPShard

log = logging.getLogger(__name__)
_PROMPT_LOGITS_ROWS = 256  # prompt-logprob logits per slice: 256 x a 49k vocabulary = 50 MB
_logged_torch_graphs_off = False  # log that once per process, not once per engine


@dataclass(frozen=True)
class PromptLogits:
    """One request's prompt logprobs in a step: ``slices`` of (first row, end row, the
    prompt tokens those rows predict); ``first_pos``: the position the first describes."""

    request_id: str
    first_pos: int
    k: int
    slices: list[tuple[int, int, list[int]]]


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


# One read of a request's KV after a layer: (request id, block ids, tokens, start).
KVRead = tuple[str, list[int], int, int]
# A follower's hand-off of its own heads of one read: (request id, layer, kv, heads).
ShardExport = Callable[[str, int, torch.Tensor, tuple[int, int]], None]


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
        self.cfg = cfg  # this rank's shapes under tensor parallelism
        self.tp = model.comm  # None: one rank
        if self.tp is not None and cuda_graphs:
            # A captured graph would need the NCCL collectives captured with it; not yet.
            log.info("CUDA graphs off under tensor parallelism")
            cuda_graphs = False
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        dtype = getattr(torch, cfg.dtype)
        self.device = model.embed.weight.device  # the model is already where it will run
        if self.tp is not None:
            shard, full = model.shard, model.full_cfg
            mine = shard.kv_heads(full)
            self._my_heads = slice(mine.start, mine.stop)  # of the model's KV heads
            # The gathered heads come rank by rank; a replicated head is taken from the first
            # rank that holds it.
            # Ranks may hold different numbers of heads (an uneven split): each pads its own to
            # the most any holds, so the gather's parts are alike.
            held = [TPShard(r, shard.size).kv_heads(full) for r in range(shard.size)]
            self._gather_heads = shard.max_kv_heads(full)
            sources = []
            for h in range(full.num_kv_heads):
                r = next(r for r in range(shard.size) if h in held[r])
                sources.append(r * self._gather_heads + h - held[r].start)
            self._head_sources = torch.tensor(sources, device=self.device)
            self._writes_lock = threading.Lock()
            self._pending_writes: list = []
            # Control messages for the other ranks, sent ahead of rank 0's next broadcast
            # (``tell``); on the other ranks, the pages reserved for arriving KV (``hold``).
            self._ctl: list = []
            self._held: dict[str, tuple[list[int], int]] = {}
        self.own_kv_heads = ((self._my_heads.start, self._my_heads.stop) if self.tp is not None
                             else (0, cfg.num_kv_heads))
        self.attn_backend = create_backend(
            attention_backend, self.device,
            AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype,
                           tuple(cfg.layer_windows) if cfg.sliding_window else (),
                           cfg.attn_softcap))
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
        # engine.executor.fused_decode.tune_fused_decode); untuned: never.
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
        if (layer_hook is None and self.tp is None and meta.num_decode == meta.num_seqs
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
        prompt_plan = self._prompt_logit_plan(inp)
        if self.tp is not None:
            self._broadcast(("step", FollowerStep(
                inp.input_ids, inp.meta, prompt_plan, inp.sample_rows,
                list(kv_reads) if layer_hook is not None else [], kv_shards)))
        if inp.bucket is not None and self.graph_runner is not None:
            hidden = self.graph_runner.run(inp.input_ids, inp.meta)
        else:
            hidden = self._forward(inp.input_ids, inp.meta, layer_hook)
        prompt_lps = self._prompt_logprobs(prompt_plan, hidden)
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

    @staticmethod
    def _prompt_logit_plan(inp: StepInputs) -> list[PromptLogits]:
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
                for p0 in range(c.start_pos, last, _PROMPT_LOGITS_ROWS):
                    p1 = min(p0 + _PROMPT_LOGITS_ROWS, last)
                    r0 = row + p0 - c.start_pos
                    slices.append((r0, r0 + p1 - p0, list(c.prompt_token_ids[p0 + 1:p1 + 1])))
                plan.append(PromptLogits(c.request_id, c.start_pos + 1, k, slices))
            row += c.num_tokens
        return plan

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
                kv = self.read_layer_kv(layer, block_ids, num_tokens, start,
                                        gather=not step.kv_shards)
                if step.kv_shards and export is not None:
                    export(rid, layer, kv, self.own_kv_heads)

        hidden = self._forward(step.input_ids, step.meta, read_kv if step.kv_reads else None)
        for p in step.prompt_plan:
            for r0, r1, _ in p.slices:
                self.model.compute_logits(hidden[r0:r1])
        if step.sample_rows:
            self.model.compute_logits(hidden[step.sample_rows])

    @torch.inference_mode()
    def follow_prompt_logits(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Rank > 0's share of ``compute_logits_for_prompt``."""
        meta = build_metadata([SeqSlice(block_ids, 0, len(token_ids))], self.block_size)
        self.model.compute_logits(self._forward(torch.tensor(token_ids, dtype=torch.int64),
                                                meta))

    @torch.inference_mode()
    def compute_logits_for_prompt(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Full-prompt logits ``[T, vocab]`` (tests compare them with transformers)."""
        if self.tp is not None:
            self._broadcast(("prompt_logits", token_ids, block_ids))
        meta = build_metadata([SeqSlice(block_ids, 0, len(token_ids))], self.block_size)
        hidden = self._forward(torch.tensor(token_ids, dtype=torch.int64), meta)
        return self.model.compute_logits(hidden)

    # ---- KV import/export (disaggregation) ------------------------------------------------
    # KV crosses workers in the model's whole layout (every KV head), whatever either side's
    # tensor parallelism: a TP engine's ranks gather their heads on export and each takes its
    # own on import, so any prefill TP size pairs with any decode TP size.
    def read_layer_kv(self, layer: int, block_ids: list[int], num_tokens: int,
                      start: int = 0, gather: bool = True) -> torch.Tensor:
        """One layer's KV of a request's positions ``[start, num_tokens)``, token-contiguous:
        ``[2, num_tokens - start, kv_heads, head_dim]`` with every KV head of the model.
        Under tensor parallelism every rank calls it (in the same order: the heads are
        all-gathered), on the engine's thread; ``gather=False``: this rank's own heads
        (``own_kv_heads``), no collective."""
        bs = self.block_size
        first, nb = start // bs, cdiv(num_tokens, bs)
        # Gather only the pages that hold [start, num_tokens), then drop the rows before start.
        k, v = gather_kv(self.kv_caches[layer],
                         torch.tensor(block_ids[first:nb], device=self.device),
                         num_tokens - first * bs)
        skip = start - first * bs
        kv = torch.stack([k[skip:], v[skip:]]) if skip else torch.stack([k, v])
        if self.tp is None or not gather:
            return kv
        if kv.shape[2] < self._gather_heads:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, self._gather_heads - kv.shape[2]))
        heads = self.tp.all_gather(kv, dim=2)  # [2, T, ranks x padded heads, D], rank order
        return heads.index_select(2, self._head_sources)

    def write_layer_kv(self, layer: int, block_ids: list[int], kv: torch.Tensor,
                       start: int = 0, heads: tuple[int, int] | None = None) -> None:
        """Scatter ``[2, num_tokens, kv_heads, head_dim]`` (every KV head of the model) into
        this runner's own pages at positions ``[start, start + num_tokens)``. Any thread.
        Under tensor parallelism rank 0 writes its heads now and queues the other ranks'
        (sent, on the engine's thread, ahead of the next step). ``heads``: ``kv`` holds only
        the model's KV heads ``[lo, hi)``, all of them this rank's (KV that arrived per rank):
        written here alone, nothing queued."""
        if heads is not None:
            self._write_own(layer, block_ids, kv, start, heads)
            return
        if self.tp is None:
            self._write_heads(layer, block_ids, kv, start)
            return
        self._write_heads(layer, block_ids, kv[:, :, self._my_heads], start)
        with self._writes_lock:
            self._pending_writes.append((layer, block_ids, kv, start))

    def _write_own(self, layer: int, block_ids: list[int], kv: torch.Tensor, start: int,
                   heads: tuple[int, int]) -> None:
        lo, hi = self.own_kv_heads
        if not lo <= heads[0] < heads[1] <= hi or kv.shape[2] != heads[1] - heads[0]:
            raise ValueError(f"KV of heads {heads[0]}..{heads[1] - 1} ({kv.shape[2]} in the "
                             f"tensor) cannot land on a rank holding {lo}..{hi - 1}")
        self._write_heads(layer, block_ids, kv, start, slice(heads[0] - lo, heads[1] - lo))

    def _write_heads(self, layer: int, block_ids: list[int], kv: torch.Tensor,
                     start: int, into: slice = slice(None)) -> None:
        n = kv.shape[1]
        bs = self.block_size
        pos = torch.arange(start, start + n, device=self.device)
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.device)[pos // bs]
        cache = self.kv_caches[layer]
        cache[blocks, 0, pos % bs, into] = kv[0].to(cache.device, cache.dtype)
        cache[blocks, 1, pos % bs, into] = kv[1].to(cache.device, cache.dtype)

    # ---- tensor parallelism: rank 0's messages to the other ranks ------------------------
    # Every broadcast is (control messages, main message): the control messages queued since
    # the last one (imported KV, reservations, agent messages) go first, in order, so a
    # follower has taken them before it runs any later step that depends on them.
    def tell(self, msg: tuple) -> None:
        """Rank 0, any thread: queue a control message for the other ranks (sent ahead of
        the next broadcast, or by ``flush_ranks``)."""
        with self._writes_lock:
            self._ctl.append(msg)

    def flush_ranks(self) -> None:
        """Rank 0, engine thread: send what is queued for the other ranks now (a step
        would send it anyway; this is for messages that must not wait for one)."""
        if self.tp is None:
            return
        with self._writes_lock:
            pending = bool(self._ctl or self._pending_writes)
        if pending:
            self._broadcast(None)

    def _broadcast(self, main: tuple | None) -> None:
        with self._writes_lock:
            writes, self._pending_writes = self._pending_writes, []
            ctl, self._ctl = self._ctl, []
        if writes:
            # Pickled through the control group: host tensors (a GPU tensor would unpickle
            # onto rank 0's device in the other ranks).
            ctl.insert(0, ("kv_writes", [(layer, block_ids, kv.cpu(), start)
                                         for layer, block_ids, kv, start in writes]))
        self.tp.broadcast((ctl, main))

    # ---- tensor parallelism: the other ranks' pages for KV arriving per rank -------------
    def hold_pages(self, request_id: str, block_ids: list[int], start: int) -> None:
        """Rank > 0: rank 0 reserved these pages for ``request_id``'s arriving KV (its
        positions from ``start`` on); ``import_heads`` may write them until ``drop_pages``."""
        with self._writes_lock:
            self._held[request_id] = (block_ids, start)

    def drop_pages(self, request_id: str) -> None:
        """Rank > 0: the reservation ended (admitted, released): no late layer lands in its
        pages once this returns, before any later step can reuse them."""
        with self._writes_lock:
            self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        """Rank > 0: reservations whose pages arriving KV may still write."""
        with self._writes_lock:
            return len(self._held)

    def import_heads(self, request_id: str, layer: int, kv: torch.Tensor,
                     heads: tuple[int, int]) -> None:
        """Rank > 0, any thread: write one arriving layer of this rank's heads into the
        pages held for ``request_id``. KeyError when the reservation has ended."""
        with self._writes_lock:  # ordered against drop_pages
            held = self._held.get(request_id)
            if held is None:
                raise KeyError(f"no reservation for {request_id!r} on rank {self.tp.rank}")
            block_ids, start = held
            self._write_own(layer, block_ids, kv, start, heads)

    def follow_kv_writes(self, writes: list) -> None:
        """Rank > 0's share of imported KV: its own heads of each queued write."""
        for layer, block_ids, kv, start in writes:
            self._write_heads(layer, block_ids, kv[:, :, self._my_heads], start)
