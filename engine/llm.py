"""The offline Python API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``.

A prompt is a ``str``, a list of token ids, or a list of chat messages. ``generate`` returns one
final ``RequestOutput`` per prompt, in order; ``stream`` yields every update as tokens appear;
``embed`` gives each prompt's pooled hidden states.
All prompts of a call run together under the engine's batching policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.contract import RequestOutput, SamplingParams
from engine.lora.request import LoRARequest
from engine.runtime.llm_engine import EngineArgs, LLMEngine, Prompt

LoRAChoice = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """One model in this process. Keyword arguments are ``EngineArgs`` fields plus ``batching``."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """End the tensor-parallel ranks this model runs on, if any (``tensor_parallel_size``
        > 1 starts one process per extra rank; they also end when this object is collected
        or the process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRAChoice = None) -> list[RequestOutput]:
        """Run all prompts to completion; one final output per prompt, in input order.
        ``lora_request``: the adapter every prompt runs under, or one per prompt (None: the
        base model); needs ``enable_lora=True``.

        Raises ValueError for bad input before anything runs (no request is left queued).
        """
        final: dict[str, RequestOutput] = {}
        ids = self._add(prompts, sampling_params, lora_request)
        for out in self._run(ids):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               lora_request: LoRAChoice = None) -> Iterator[RequestOutput]:
        """Yield each update (new tokens, ``delta_text``) as the engine produces it."""
        yield from self._run(self._add(prompts, sampling_params, lora_request))

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | None = None,
             lora_request: LoRAChoice = None) -> list[RequestOutput]:
        """``generate`` for chat conversations (the model's chat template is applied)."""
        return self.generate(messages, sampling_params, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last",
              normalize: bool = True, lora_request: LoRAChoice = None) -> list[list[float]]:
        """One embedding per prompt, in order: the prompt's final hidden states (after the
        model's last norm) pooled, ``last`` (the last token's: the default for decoder
        LMs), ``mean`` or ``cls``, L2-normalized unless ``normalize`` is False
        (engine.executor.pooling). Raises ValueError for bad input before anything runs."""
        params = SamplingParams(max_tokens=1, temperature=0, pooling=pooling,
                                normalize=normalize)
        return [o.embedding for o in self.generate(prompts, params, lora_request)]

    # ---- internals ----------------------------------------------------------------------
    def _add(self, prompts, sampling_params, lora_request: LoRAChoice = None) -> list[str]:
        items = _as_prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams() for _ in items]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} sampling params for {len(items)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(items)
        else:
            loras = list(lora_request)
            if len(loras) != len(items):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(items)} prompts")
        # Validate everything first so a bad prompt leaves nothing half-queued.
        reqs = [self.engine.make_request(p, sp, lora_request=lr)
                for p, sp, lr in zip(items, params, loras, strict=True)]
        for r in reqs:
            self.engine.enqueue(r)
        return [r.request_id for r in reqs]

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:  # consumer stopped early: free their KV
                self.engine.abort_request(rid)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts:
        first = prompts[0]
        if isinstance(first, int | dict):
            return [list(prompts)]  # one token-id prompt, or one chat conversation
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("no prompts given")
        return list(prompts)
    raise ValueError(f"unsupported prompt type {type(prompts).__name__}")
