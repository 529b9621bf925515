"""Reading a model's weights: its ``*.safetensors`` shards (whole, or a tensor-parallel rank's
slices), the GGUF blocks a converted directory keeps as stored, and both into a built model.

Finding the model directory (and converting a GGUF into one) is ``engine.weights.resolve``'s,
which needs no torch. Nothing here reads the environment or downloads anything.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.quant.layouts import QuantizedWeight, cat_rows
from engine.weights.converted import QUANTIZED_FILE

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


def load_state_dict(model_dir: str | Path, dtype: torch.dtype,
                    select: Callable[[str], tuple | None] | None = None,
                    skip: set[str] | frozenset[str] = frozenset()
                    ) -> dict[str, torch.Tensor]:
    """All tensors of the model's ``*.safetensors`` shards, HF names, floats cast to ``dtype``.

    ``select(name)``: ``(dim, start, stop)`` to read only that slice of a tensor (a
    tensor-parallel rank's part: ``TPShard.slice_of``), or ``(dim, ((start, stop), ...))``
    for the parts of a fused tensor, concatenated; None for the whole tensor. Only the slices
    are read from the file. Tensors named in ``skip`` are not read at all (those a quantized
    load takes from ``load_quantized_state_dict``). Follows ``model.safetensors.index.json``
    when present.
    Raises ValueError when the directory has no safetensors weights (``.bin`` checkpoints are
    not supported: re-save as safetensors).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(s) for s in shards if not s.is_file()]
        if missing:
            raise ValueError(f"weight shards listed in {index.name} are missing: {missing}")
    else:
        shards = sorted(p for p in model_dir.glob("*.safetensors") if p.name != QUANTIZED_FILE)
    if not shards:
        has_bin = any(model_dir.glob("*.bin"))
        raise ValueError(
            f"no *.safetensors weights in {str(model_dir)!r}"
            + (" (found .bin files; re-save the model with safe_serialization)" if has_bin else "")
        )
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = language_model_name(stored)
                if name is None or name in skip:
                    continue
                part = select(name) if select is not None else None
                if part is None:
                    t = f.get_tensor(stored)
                else:
                    dim, *where = part
                    sl = f.get_slice(stored)
                    ranges = where[0] if len(where) == 1 else [tuple(where)]
                    t = torch.cat([sl[a:b] if dim == 0 else sl[:, a:b] for a, b in ranges],
                                  dim=dim)
                state[name] = t.to(dtype) if t.is_floating_point() else t
    return state


# An image+text checkpoint (Gemma 3 4B-27B) keeps its language model under a prefix, beside a
# vision tower and projector this engine does not serve: (prefix, what it becomes), in the
# layout transformers saves and in its in-memory one.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
_NOT_LANGUAGE_MODEL = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                       "model.multi_modal_projector.")


def language_model_name(stored: str) -> str | None:
    """A checkpoint tensor's name as the language model knows it (``model.layers.0...``);
    None for the tensors of an image tower, which are never read."""
    if stored.startswith(_NOT_LANGUAGE_MODEL):
        return None
    for prefix, becomes in _LANGUAGE_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return becomes + stored[len(prefix):]
    return stored



def has_quantized_blocks(model_dir: str | Path) -> bool:
    """Whether a GGUF conversion in ``model_dir`` kept any tensor in our layouts (what
    ``--quantization gguf``, and ``auto`` for such a model, serves); reads the file's header
    only."""
    from safetensors import safe_open

    path = Path(model_dir) / QUANTIZED_FILE
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        return bool(json.loads((f.metadata() or {}).get("layouts", "{}")))


def load_quantized_state_dict(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                              select: Callable[[str], tuple | None] | None = None
                              ) -> dict[str, QuantizedWeight]:
    """The quantized weights a GGUF conversion kept in ``engine.quant.layouts`` layouts (HF names ->
    ``QuantizedWeight``, activations in ``dtype``); empty when the directory has none (not
    converted from a GGUF, or no tensor of a type that maps onto a layout). Reads only those
    tensors. ``select``: a TP rank's slices (``load_state_dict``'s): rows as they are, a cut
    along the input at whole blocks; a tensor whose cut falls inside a block is left out (the
    caller reads it in the model dtype from the fp32 conversion, and logs it)."""
    from safetensors import safe_open

    path = Path(model_dir) / QUANTIZED_FILE
    if not path.is_file():
        return {}
    out = {}
    with safe_open(str(path), framework="pt") as f:
        layouts = json.loads((f.metadata() or {}).get("layouts", "{}"))
        for name, lay in layouts.items():
            offset = f.get_tensor(name + ".qoffset") if lay["kind"] == "int4" else None
            w = QuantizedWeight(lay["kind"], f.get_tensor(name + ".qdata"),
                                f.get_tensor(name + ".qscale"), offset, int(lay["group"]), dtype)
            part = select(name) if select is not None else None
            if part is not None:
                w = _rank_slice(w, part)
                if w is None:
                    log.info("%s: this rank's cut falls inside a %d-weight block; read in "
                             "the model dtype", name, int(lay["group"]))
                    continue
            out[name] = w
    return out


def _rank_slice(w: QuantizedWeight, part: tuple) -> QuantizedWeight | None:
    """``w``'s share for ``part`` (``TPShard.slice_of``'s ``(dim, start, stop)`` or ``(dim,
    ((start, stop), ...))``), or None where a cut along the input is not on a block boundary.
    Copies, so the whole tensor read from the file is freed."""
    dim, *where = part
    ranges = where[0] if len(where) == 1 else [tuple(where)]
    if dim == 0:
        return cat_rows([w.row_slice(a, b) for a, b in ranges])  # torch.cat: a copy
    if any(a % w.group or b % w.group for a, b in ranges):
        return None
    per = 2 if w.kind == "int4" else 1  # weights a byte
    data = torch.cat([w.data[:, a // per:b // per] for a, b in ranges], dim=1)
    scale = torch.cat([w.scale[:, a // w.group:b // w.group] for a, b in ranges], dim=1)
    offset = (None if w.offset is None else
              torch.cat([w.offset[:, a // w.group:b // w.group] for a, b in ranges], dim=1))
    return QuantizedWeight(w.kind, data.contiguous(), scale.contiguous(),
                           None if offset is None else offset.contiguous(), w.group, w.dtype)


def load_weights(model: LlamaForCausalLM, model_dir, quantization: str,
                 select: Callable[[str], tuple | None] | None = None) -> None:
    """Load ``model``'s weights from ``model_dir`` as ``quantization`` asks (``select``: this
    TP rank's slices): "gguf" takes the converted GGUF's quantized tensors as they are and
    reads only the rest in the model dtype; "int8"/"int4" quantize the fp weights after
    loading (every TP rank its own shard) and free them."""
    dtype = getattr(torch, model.cfg.dtype)
    quantized = {}
    if quantization == "gguf":
        quantized = load_quantized_state_dict(model_dir, dtype, select)
        if not quantized:
            raise ValueError(f"quantization='gguf': {str(model_dir)!r} holds no GGUF tensors "
                             "in Q8_0 / Q4_0 / Q4_1 / Q4_K blocks (the model is not a GGUF, "
                             "or none of its types maps onto a layout); use int8, int4 or none")
    model.load_hf_state_dict(load_state_dict(model_dir, dtype, select, skip=set(quantized)),
                             quantized)
    if quantization in ("int8", "int4"):
        model.quantize(quantization)
        gc.collect()
