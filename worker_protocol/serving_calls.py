"""The calls both worker kinds answer the same way, over their ``adapters``
(``worker_protocol.adapters.WorkerAdapters``) and ``embeddings``
(``worker_protocol.embeddings.WorkerEmbeddings``): a worker class inherits them."""

from __future__ import annotations

from engine.lora.request import LoRARequest
from worker_protocol.adapters import LoRALoaded
from worker_protocol.embeddings import EmbedRequest, EmbedResult


class ServingCalls:
    """LoRA load / unload and embeddings, for a worker with ``adapters`` and ``embeddings``."""

    def load_lora(self, req: LoRARequest) -> LoRALoaded:
        """Hold LoRA adapter ``req`` (worker_protocol.adapters); ValueError names why not."""
        return self.adapters.load(req)

    def unload_lora(self, name: str) -> bool:
        """Drop adapter ``name`` (False: not held); ValueError while requests use it here."""
        return self.adapters.unload(name)

    def embed(self, req: EmbedRequest) -> EmbedResult:
        """A prompt's pooled hidden states (worker_protocol.embeddings): no KV leaves."""
        return self.embeddings.embed(req)
