"""Embeddings over the cluster (``GenerationBackend.embed``): each input is prefill-only work,
routed like a prompt (the KV index's prefix hits, the queued prompt tokens) to a prefill
worker, or to a worker of a colocated cluster, which returns its pooled vector
(``worker_protocol.embeddings``). No decode worker reserves anything for it; its full blocks
stay in the worker's prefix cache for the prompts that follow."""

from __future__ import annotations

import asyncio
import itertools

from engine.contract import SamplingParams
from router.contract import (
    EmbedInput,
    EmbedOutput,
    InvalidRequestError,
    WorkerUnavailableError,
    new_request_id,
)
from router.control.request_state import cause_of
from worker_protocol.embeddings import EmbedRequest

# Inputs in one call (OpenAI's limit is 2048).
MAX_EMBED_INPUTS = 2048


class EmbeddingBackend:
    """``GenerationBackend.embed`` for a backend whose ``orchestrator`` runs the cluster and
    whose ``config`` (a ClusterConfig) says how to pool (``router.cluster.ray_cluster.Cluster``)."""

    async def embed(self, inp: EmbedInput) -> EmbedOutput:
        orch = self.orchestrator
        if not inp.inputs or len(inp.inputs) > MAX_EMBED_INPUTS:
            raise InvalidRequestError(f"input: 1 to {MAX_EMBED_INPUTS} items, got "
                                      f"{len(inp.inputs)}")
        lora = orch.adapters.resolve(inp.model)
        cfg = self.config
        params = SamplingParams(max_tokens=1, temperature=0, pooling=cfg.pooling,
                                normalize=cfg.normalize_embeddings)
        ids = []
        for i, item in enumerate(inp.inputs):
            try:
                enc = orch.inputs.encode(item)
                orch.inputs.validate(len(enc.token_ids), params)
            except ValueError as e:
                where = f"input[{i}]: " if len(inp.inputs) > 1 else "input: "
                raise InvalidRequestError(where + str(e)) from e
            ids.append(enc.token_ids)
        orch.adapters.admitted(lora)  # every input valid: the request counts
        rid = inp.request_id or new_request_id()
        seq = itertools.count()
        vectors = await asyncio.gather(*[self._embed_one(f"{rid}-emb{next(seq)}", p, lora)
                                         for p in ids])
        return EmbedOutput(list(vectors), sum(len(p) for p in ids))

    async def _embed_one(self, rid: str, prompt: list[int], lora) -> list[float]:
        """One input on one worker; a worker that fails it is left out of one more try."""
        orch, cfg = self.orchestrator, self.config
        slots = orch.prefill if orch.config.mode == "disaggregated" else orch.decode
        excluded: set[str] = set()
        last: BaseException | None = None
        for _ in range(2):
            slot, work = orch.choose.prefill(slots, prompt, excluded, lora)
            req = EmbedRequest(rid, prompt, cfg.pooling, cfg.normalize_embeddings,
                               lora.request if lora is not None else None,
                               orch.config.prefill_timeout_s)
            slot.view.inflight_prefill_tokens += work
            try:
                res = await asyncio.wait_for(slot.handle.embed.remote(req),
                                             req.timeout_s + orch.config.call_timeout_s)
            except Exception as e:
                cause = cause_of(e)
                if isinstance(cause, ValueError):  # the input's fault: no other worker helps
                    raise InvalidRequestError(str(cause)) from None
                last, excluded = cause, excluded | {slot.info.worker_id}
                continue
            finally:
                slot.view.inflight_prefill_tokens -= work
            return res.embedding
        raise WorkerUnavailableError(f"embedding {rid} failed on two workers; last error: "
                                     f"{last!r}")
