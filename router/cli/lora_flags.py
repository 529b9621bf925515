"""`pdcluster serve`'s LoRA flags (vLLM's names): ``--enable-lora``, ``--lora-modules name=DIR
...``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, ``--lora-dtype``; checked
once here, before any worker starts (docs/lora.md)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

LORA_DTYPES = ("auto", "float32", "float16", "int8")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters of the base model, chosen per request by "
                        "`model` (loaded with --lora-modules or POST /v1/load_lora_adapter)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=DIR",
                   help="adapters served from the start: name=PEFT folder (adapter_config.json "
                        "+ adapter_model.safetensors), or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'")
    g.add_argument("--max-loras", type=int, default=None,
                   help="most adapters in one running batch per worker (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest adapter rank accepted (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters each worker keeps loaded, least recently used dropped "
                        "first (default: --max-loras)")
    g.add_argument("--lora-dtype", choices=list(LORA_DTYPES), default=None,
                   help="adapter weights: auto (the model's dtype), float32, float16 or int8 "
                        "(a scale per rank row)")


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


def parse_lora_modules(value) -> tuple[LoRAModule, ...]:
    """``--lora-modules`` (a list of "name=DIR" or vLLM's JSON objects; in YAML also a
    mapping name -> DIR) as modules, in order. ValueError names the bad entry: no name, a
    name twice, a folder without adapter_config.json."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [_entry(v) for v in value]
    else:
        raise ValueError(f"--lora-modules: expected name=DIR entries, got {value!r}")
    out, seen = [], set()
    for name, path in items:
        if not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {name!r}: needs a name and a folder")
        if name in seen:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        seen.add(name)
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"--lora-modules: {name}={path}: no adapter_config.json there "
                             "(a PEFT adapter folder)")
        out.append(LoRAModule(name, str(path)))
    return tuple(out)


def _entry(v) -> tuple[str, object]:
    if isinstance(v, dict):
        return str(v.get("name", "")), v.get("path")
    text = str(v).strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not JSON ({e})") from None
        return _entry(d if isinstance(d, dict) else text)
    name, eq, path = text.partition("=")
    if not eq:
        raise ValueError(f"--lora-modules: {text!r}: expected name=DIR")
    return name.strip(), path.strip()


def check_lora_flags(cfg) -> None:
    """``cfg``'s (a ServeConfig) LoRA settings: ValueError for modules without
    --enable-lora, bounds below 1, an unknown dtype."""
    modules = parse_lora_modules(cfg.lora_modules)
    if modules and not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if cfg.enable_lora not in (True, False):
        raise ValueError(f"--enable-lora must be true or false, got {cfg.enable_lora!r}")
    for flag in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        v = getattr(cfg, flag)
        if v is None and flag == "max_cpu_loras":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {v!r}")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"--max-cpu-loras ({cfg.max_cpu_loras}) must be >= --max-loras "
                         f"({cfg.max_loras})")
    if cfg.lora_dtype not in LORA_DTYPES:
        raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, "
                         f"got {cfg.lora_dtype!r}")


def lora_cpu_slots(cfg) -> int | None:
    """Adapters each worker of ``cfg`` (a ServeConfig) holds: --max-cpu-loras, else enough
    for --max-loras and every --lora-modules adapter (each would otherwise push another out
    at start)."""
    if cfg.max_cpu_loras is not None or not cfg.enable_lora:
        return cfg.max_cpu_loras
    return max(cfg.max_loras, len(parse_lora_modules(cfg.lora_modules)))
