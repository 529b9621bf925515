"""Tiny random LoRA adapters made with ``peft`` itself, and ``peft``'s own greedy tokens: the
references the engine's adapters are held to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.helpers.tiny_models import load_hf

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(model_dir: Path | None, arch: str, out: Path, *, r: int = 4, alpha: float = 8,
                 targets: list[str] | None = None, seed: int = 0, use_rslora: bool = False,
                 scale: float = 1.0, base=None, **config) -> Path:
    """A PEFT LoRA adapter of the model at ``model_dir`` (or of the transformers model
    ``base``) with random A and B (``scale`` multiplies B: how far the adapter moves the
    base's logits), saved with ``save_pretrained``; ``config``: more ``LoraConfig`` fields
    (e.g. ``use_dora``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base if base is not None else load_hf(model_dir, arch), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets or ["q_proj", "v_proj"],
        lora_dropout=0.0, use_rslora=use_rslora, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5 * scale)
            elif "lora_A" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def peft_greedy(model_dir: Path, arch: str, adapter_dir: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """transformers + peft greedy tokens of each prompt under the adapter (None: the base)."""
    model = load_hf(model_dir, arch)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@contextmanager
def step_adapters(llm) -> Iterator[list[set]]:
    """The adapters (None: the base) of each step's chunks as the engine's runner (rank 0's,
    under TP) is handed them, while the block runs; the runner is restored after."""
    runner = llm.engine.runner
    real, steps = runner.execute, []

    def execute(sched, *args, **kwargs):
        steps.append({c.lora_name for c in sched.chunks})
        return real(sched, *args, **kwargs)

    runner.execute = execute
    try:
        yield steps
    finally:
        runner.execute = real
