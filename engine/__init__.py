"""The engine both worker kinds share: model, paged KV cache, scheduler, sampling.

No Ray and no gRPC in here. ``from engine import LLM, SamplingParams`` is the offline API.
Imports are lazy so the pure modules (scheduler, block manager) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "EngineArgs", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from engine.args import EngineArgs
    from engine.contract import RequestOutput, SamplingParams
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.runtime.llm_engine import LLMEngine


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "EngineArgs":  # plain data: no torch (a router's door imports it)
        from engine.args import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from engine.runtime.llm_engine import LLMEngine
        return LLMEngine
    if name == "LoRARequest":  # plain data: no torch
        from engine.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "SamplingParams"):
        from engine import contract
        return getattr(contract, name)
    raise AttributeError(name)
