"""``LoRARequest``: which adapter a request runs under (vLLM's names). Plain data, no torch: the
core scheduler and the router carry it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract import QueueFullError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by ``lora_name`` (what the ``model`` field names), a positive
    ``lora_int_id`` unique per adapter in an engine, and ``lora_path``: a PEFT adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``). Raises ValueError for an
    empty name or path, or an id below 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path")


class AdaptersBusyError(QueueFullError, ValueError):
    """A new adapter cannot be held now: every held one (``max_cpu_loras``) has unfinished
    requests under it. Transient: it can be held once one of them finishes (a worker waits
    for that, bounded; a caller that does not wait gets HTTP 429 / RESOURCE_EXHAUSTED). A
    ValueError too, like every other refused load."""
