"""A PEFT LoRA adapter read from disk, checked against the base model, and laid out against our
fused projections (``LoRAAdapter``).

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` whose tensors are
``base_model.model.model.layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight``:
A ``[r, in]`` and B ``[out, r]``, and a layer's output gains ``s * B (A x)`` with ``s =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Our decoder fuses q/k/v into
one ``qkv`` projection and gate/up into ``gate_up``, so an adapter's A matrices of one fused
projection are stacked (one shrink for the whole input) and each B, scaled by ``s``, expands its
own columns of the output. Anything that would change that math and is not implemented (DoRA,
per-module ranks or alphas, embedding or LM-head targets, trained biases, modules saved whole)
is refused by name when the adapter loads, never ignored."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig
from engine.parallel.sharding import TPShard

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # ours, in LoRAAdapter.descs' order
KERNEL_DTYPES = (torch.float32, torch.float16, torch.int8)  # what cpu_ops.c's LoRA reads
# outputs per block of a part's B as the C kernel reads it (cpu_ops.c's LORA_OUT)
B_BLOCK = 64
# PEFT's module name -> (our projection, its part: q/k/v of qkv, gate/up of gate_up)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change the product when set; their "off" values
_REFUSED = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "modules_to_save": (None, []), "bias": ("none",), "lora_bias": (False, None),
            "fan_in_fan_out": (False, None), "layer_replication": (None, []),
            "trainable_token_indices": (None, {}, []), "target_parameters": (None, [])}


@dataclass
class ProjectionLoRA:
    """One fused projection's adapter: ``a [R, K]`` (the parts' A stacked) and ``parts``: for
    each targeted part, ``(out_start, out_end, r_start, r_end, bt)`` with ``bt`` its B,
    already scaled, in the C kernel's layout: transposed and cut in blocks of ``B_BLOCK``
    outputs, each block ``[r, width]`` contiguous, one after another (``b_matrix`` gives B
    back). int8 (``lora_dtype="int8"``): ``scale [R]`` fp32, rank row r's A row scale times
    its B row's (``A x`` row r times it, then B's integers: ``quantize_int8``)."""

    a: torch.Tensor
    parts: list[tuple[int, int, int, int, torch.Tensor]]
    scale: torch.Tensor | None = None

    def desc(self) -> torch.Tensor:
        """The C kernel's view (``cpu_ops.c`` ``lora_apply``): int64 ``[R, nparts, &a, kind,
        {o0, o1, r0, r1, &bt} x nparts]`` (kind 0 fp32, 1 fp16, 2 int8, then ``&scale``);
        valid while this object holds its tensors."""
        kind = {torch.float16: 1, torch.int8: 2}.get(self.a.dtype, 0)
        flat = [self.a.shape[0], len(self.parts), self.a.data_ptr(), kind]
        for o0, o1, r0, r1, bt in self.parts:
            flat += [o0, o1, r0, r1, bt.data_ptr()]
        if kind == 2:
            flat.append(self.scale.data_ptr())
        return torch.tensor(flat, dtype=torch.int64)


@dataclass
class LoRAAdapter:
    """An adapter loaded for one base model: per layer, our projection name -> its
    ``ProjectionLoRA`` (absent: not targeted). ``key``: a 64-bit identity of the adapter's
    bytes (never 0, the base model's), which seeds its requests' block hashes so two adapters
    (or an adapter and the base) never share KV."""

    request: LoRARequest
    rank: int
    scaling: float
    key: int
    layers: list[dict[str, ProjectionLoRA]] = field(default_factory=list)
    # per layer and projection (PROJECTIONS' order) the address of its ProjectionLoRA.desc,
    # 0 where not adapted: [num_layers, 4] int64 (made by finish)
    desc_ptrs: torch.Tensor | None = None
    # what it was laid out from, until it is shipped to the other tensor-parallel ranks
    # (engine.lora.registry); None otherwise
    source: PeftTensors | None = field(default=None, repr=False)
    _descs: list[torch.Tensor] = field(default_factory=list, repr=False)
    # (made by finish) the largest stacked rank of any projection (the kernel's scratch
    # width), and whether every tensor is in a dtype the C kernel reads (fp32, fp16, int8)
    rmax: int = 0
    c_kernel: bool = False

    def finish(self) -> LoRAAdapter:
        """Make ``desc_ptrs``, ``rmax`` and ``c_kernel`` (once the layers are complete)."""
        held = [p for layer in self.layers for p in layer.values()]
        self.rmax = max((p.a.shape[0] for p in held), default=0)
        self.c_kernel = all(p.a.dtype in KERNEL_DTYPES for p in held)
        ptrs = torch.zeros(len(self.layers), len(PROJECTIONS), dtype=torch.int64)
        for i, layer in enumerate(self.layers):
            for j, name in enumerate(PROJECTIONS):
                if name in layer:
                    d = layer[name].desc()
                    self._descs.append(d)
                    ptrs[i, j] = d.data_ptr()
        self.desc_ptrs = ptrs
        return self

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size()
                   + sum(bt.numel() * bt.element_size() for *_, bt in p.parts)
                   + (0 if p.scale is None else p.scale.numel() * 4)
                   for layer in self.layers for p in layer.values())


def quantize_int8(a: torch.Tensor, bt: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a [r, K]`` and ``bt [r, N]`` (B transposed, scaled) as int8, symmetric, one scale per
    row of each (its largest magnitude over 127): ``(a8, bt8, scale)`` with ``scale [r]`` the
    two rows' scales multiplied, so ``bt.T @ (a @ x) ~= bt8.T @ (scale * (a8 @ x))``. Each
    value is within half a step of its row's scale (1/254 of the row's largest)."""
    sa = a.abs().amax(dim=1).clamp_min(1e-30) / 127
    sb = bt.abs().amax(dim=1).clamp_min(1e-30) / 127
    a8 = torch.round(a / sa[:, None]).clamp(-127, 127).to(torch.int8)
    bt8 = torch.round(bt / sb[:, None]).clamp(-127, 127).to(torch.int8)
    return a8, bt8, (sa * sb).to(torch.float32)


def _blocked(bt: torch.Tensor) -> torch.Tensor:
    """``bt [r, n]`` as ``ProjectionLoRA`` holds it: blocks of ``B_BLOCK`` columns, each
    ``[r, width]`` contiguous, concatenated (1-D)."""
    return torch.cat([bt[:, i:i + B_BLOCK].contiguous().flatten()
                      for i in range(0, bt.shape[1], B_BLOCK)])


def b_matrix(part: tuple) -> torch.Tensor:
    """A part's scaled B ``[out_end - out_start, r_end - r_start]`` from its blocked layout."""
    o0, o1, r0, r1, flat = part
    r, n = r1 - r0, o1 - o0
    cols, at = [], 0
    for i in range(0, n, B_BLOCK):
        w = min(B_BLOCK, n - i)
        cols.append(flat[at:at + r * w].view(r, w))
        at += r * w
    return torch.cat(cols, dim=1).T


def _part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """PEFT module -> (in features, out features, first output column in our projection)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (e, q, 0), "k_proj": (e, kv, q), "v_proj": (e, kv, q + kv),
            "o_proj": (q, e, 0), "gate_proj": (e, i, 0), "up_proj": (e, i, i),
            "down_proj": (i, e, 0)}


def read_adapter_config(path: Path) -> dict:
    """``adapter_config.json`` of the adapter folder ``path``, checked: a LoRA adapter with
    nothing set that this engine would have to ignore. Raises ValueError naming the problem."""
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r}: no such directory")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} (a PEFT adapter folder "
                         "holds adapter_config.json and adapter_model.safetensors)")
    try:
        conf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON: {e}") from e
    if not isinstance(conf, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    kind = conf.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type {kind!r} is not supported "
                         "(LoRA only)")
    for name, off in _REFUSED.items():
        if name in conf and conf[name] not in off:
            what = "DoRA (use_dora)" if name == "use_dora" else name
            raise ValueError(f"LoRA adapter {str(path)!r}: {what} = {conf[name]!r} is not "
                             "supported")
    r = conf.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer, got {r!r}")
    alpha = conf.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"LoRA adapter {str(path)!r}: lora_alpha must be positive, "
                         f"got {alpha!r}")
    return conf


@dataclass
class PeftTensors:
    """An adapter as read from disk and checked against the whole base model, before it is
    laid out for one rank (``lay_out``): ``tensors`` maps (layer, PEFT module) to its ``A`` and
    ``B`` as saved. Under tensor parallelism rank 0 ships this to the other ranks, so every
    rank lays out its shard of the very bytes rank 0 read (and keyed)."""

    request: LoRARequest
    rank: int
    scaling: float
    key: int
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]]


def read_peft(req: LoRARequest, cfg: ModelConfig, max_rank: int) -> PeftTensors:
    """Read and check ``req``'s adapter for a base model of ``cfg`` (the whole model's
    shapes): rank at most ``max_rank``, every tensor one of q/k/v/o/gate/up/down of a layer the
    model has with the model's shapes. Raises ValueError naming what is wrong (a missing file,
    a refused setting, a tensor of another base model)."""
    from safetensors.torch import load_file

    path = Path(req.lora_path)
    conf = read_adapter_config(path)
    rank = conf["r"]
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        bin_file = " (adapter_model.bin, a pickle, is not read)" if (
            path / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no {WEIGHTS_FILE}{bin_file}")
    raw = weights.read_bytes()
    key = xxhash.xxh3_64_intdigest((path / CONFIG_FILE).read_bytes() + raw) or 1
    tensors = load_file(str(weights))
    scaling = conf.get("lora_alpha", rank) / (math.sqrt(rank) if conf.get("use_rslora")
                                             else rank)
    shapes = _part_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"{where}: tensor {name!r} is not supported: LoRA on the "
                             "q/k/v/o/gate/up/down projections only")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}; the base model "
                             f"has {cfg.num_layers} (an adapter of another base model?)")
        k, n, _ = shapes[module]
        want = (rank, k) if ab == "A" else (n, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the base "
                             f"model's {module} takes {list(want)} at rank {rank} (an adapter "
                             "of another base model?)")
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_"
                             f"{''.join(sorted(ab))} without its pair")
    return PeftTensors(req, rank, scaling, key, found)


def lay_out(peft: PeftTensors, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
            shard: TPShard | None = None) -> LoRAAdapter:
    """``peft`` laid out against our fused projections for rank ``shard`` of a base model of
    ``cfg`` (the whole model's config; None: one rank). Each A and B is cut where the base
    weight it adapts is cut (``TPShard.slice_of``, docs/lora.md): a column-parallel projection
    (q/k/v, gate/up) keeps A whole and B's rows of this rank's outputs; a row-parallel one
    (o, down) keeps A's columns of this rank's inputs and B whole, so each rank adds its
    partial product before the layer's all-reduce sums them."""
    shard = shard or TPShard()
    local = _part_shapes(shard.local_config(cfg))
    adapter = LoRAAdapter(peft.request, peft.rank, peft.scaling, peft.key,
                          [{} for _ in range(cfg.num_layers)])
    for (layer, module), ab in sorted(peft.tensors.items(),
                                      key=lambda kv: (kv[0][0], TARGETS[kv[0][1]])):
        proj, _ = TARGETS[module]
        _, n, col = local[module]
        a, b = ab["A"], ab["B"]
        cut = shard.slice_of(f"model.layers.{layer}.{module}.weight", cfg)
        if cut is not None:
            dim, lo, hi = cut
            if dim == 0:  # column-parallel: this rank's output rows of B
                b = b[lo:hi]
            else:  # row-parallel: this rank's input columns of A
                a = a[:, lo:hi]
        held = adapter.layers[layer].get(proj)
        r0 = 0 if held is None else held.a.shape[0]
        scale = None
        if dtype == torch.int8:
            a, bt, scale = quantize_int8(a.to(torch.float32),
                                         (b.to(torch.float32) * peft.scaling).T)
            bt = _blocked(bt)
        else:
            a = a.to(dtype)
            bt = _blocked((b.to(torch.float32) * peft.scaling).to(dtype).T)
        part = (col, col + n, r0, r0 + peft.rank, bt)
        if held is None:
            adapter.layers[layer][proj] = ProjectionLoRA(a.contiguous(), [part], scale)
        else:
            adapter.layers[layer][proj] = ProjectionLoRA(
                torch.cat([held.a, a]).contiguous(), [*held.parts, part],
                None if scale is None else torch.cat([held.scale, scale]))
    return adapter.finish()


def load_adapter(req: LoRARequest, cfg: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32, shard: TPShard | None = None
                 ) -> LoRAAdapter:
    """``read_peft`` then ``lay_out``: ``req``'s adapter read, checked (ValueError naming
    what is wrong) and laid out for rank ``shard`` (None: one rank)."""
    return lay_out(read_peft(req, cfg, max_rank), cfg, dtype, shard)
