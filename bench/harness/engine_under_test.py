"""The engine under test: building it (``load_llm``, ``model_config``), its size
(``model_size``), and timing its steps from the model runner (``StepRecorder``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One executed engine step as seen by the model runner."""

    num_seqs: int
    num_tokens: int
    is_decode: bool  # every scheduled chunk is a single token
    duration_s: float
    # torch's thread count in this process when the step ran: the engine's governor drops to
    # fewer threads while a neighbour takes the CPU (engine.runtime.cpu_threads), and a step
    # then runs slower. A tensor-parallel engine's other ranks run in processes of their own:
    # this is rank 0's count only
    threads: int = 0


class StepRecorder:
    """Times every ``runner.execute`` of an engine (the forward + sampling, no scheduling).

    Installs a timing wrapper on the engine's runner instance; ``close()`` removes it. Steps the
    scheduler found empty never reach the runner, so ``records`` counts working steps only.
    """

    def __init__(self, engine: Any) -> None:
        import time

        import torch

        self._runner = engine.runner
        self.records: list[StepRecord] = []
        inner = engine.runner.execute

        def timed(sched, *args, **kwargs):
            t0 = time.perf_counter()
            result = inner(sched, *args, **kwargs)
            self.records.append(StepRecord(
                num_seqs=len(sched.chunks), num_tokens=sched.num_batched_tokens,
                is_decode=all(c.num_tokens == 1 for c in sched.chunks),
                duration_s=time.perf_counter() - t0, threads=torch.get_num_threads()))
            return result

        self._runner.execute = timed

    def reset(self) -> None:
        self.records.clear()

    def close(self) -> None:
        self._runner.__dict__.pop("execute", None)

    def decode_step_times(self, num_seqs: int | None = None) -> list[float]:
        """Durations of pure-decode steps (optionally only those with exactly ``num_seqs``)."""
        return [r.duration_s for r in self.records
                if r.is_decode and (num_seqs is None or r.num_seqs == num_seqs)]

    def decode_threads(self, num_seqs: int | None = None) -> dict[int, int]:
        """How many of ``decode_step_times(num_seqs)``'s steps ran at each thread count."""
        out: dict[int, int] = {}
        for r in self.records:
            if r.is_decode and (num_seqs is None or r.num_seqs == num_seqs):
                out[r.threads] = out.get(r.threads, 0) + 1
        return out


@dataclass(frozen=True)
class ModelSize:
    num_params: int
    weight_bytes: int


def model_size(model: Any) -> ModelSize:
    """Unique parameters and their bytes; tied embeddings count once, as they are read once
    per decode step (as the LM head)."""
    seen: set[int] = set()
    n = b = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
        b += p.numel() * p.element_size()
    return ModelSize(n, b)


def model_config(model: str | None) -> Any:
    """Our engine's ModelConfig for ``model`` (converting the default GGUF on first use)."""
    from engine.weights.resolve import load_model_config, resolve_model

    return load_model_config(resolve_model(None if model in (None, "default") else model).model_dir)


def load_llm(model: str | None, **kwargs: Any) -> Any:
    """Build ``engine.LLM`` (``model`` "default" or None -> the default model)."""
    from engine import LLM

    return LLM(model=None if model in (None, "default") else model, **kwargs)
