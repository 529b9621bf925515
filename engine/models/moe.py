"""Mixture-of-Experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks ``top_k``
of ``num_experts`` SwiGLU experts per token and mixes their outputs by the router's weights;
Qwen2-MoE adds a shared expert every token goes through, scaled by a sigmoid gate.

Routing is transformers' own: softmax over the router logits in fp32, the top ``k``, then
renormalized to sum to 1 where the family does it (Mixtral always; Qwen2/3-MoE when
``norm_topk_prob``), cast to the model's dtype. Each expert runs once per step on the rows
routed to it (one GEMM pair over those rows, not one per token), so a batch's cost grows with
the experts it touches, not with its tokens x k.

Under tensor parallelism every expert is cut like the dense MLP (its gate/up rows and down
columns by intermediate size, ``engine.parallel.sharding``); the router is replicated, so every
rank routes alike, and the layer's one all-reduce sums the partial outputs (the shared expert
is cut the same way by its own size; its gate is replicated and scales each partial sum).

``quantize`` puts every expert's gate/up and down (and the shared expert's) in an
``engine.quant.layouts`` layout, one ``QuantizedWeight`` per expert; the router and the shared
expert's gate stay in the model dtype (tiny, and they choose the experts).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.ops import cpu_ops
from engine.ops.linear import linear
from engine.quant.layouts import QuantizedWeight, cat_rows, quantize


class SparseMoE(nn.Module):
    """``forward(x [T, hidden]) -> [T, hidden]`` (this rank's partial sum under TP)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, i, hidden = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.router = nn.Parameter(torch.empty(e, hidden, dtype=dtype), requires_grad=False)
        # Per expert: [gate | up] rows (as the dense MLP's fused gate_up) and the down columns.
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, hidden, dtype=dtype),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, hidden, i, dtype=dtype), requires_grad=False)
        # Qwen2-MoE's shared expert: every token, scaled by sigmoid(x . shared_gate).
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            n = cfg.shared_expert_intermediate_size
            self.shared = nn.ParameterDict({
                "gate_up": nn.Parameter(torch.empty(2 * n, hidden, dtype=dtype), requires_grad=False),
                "down": nn.Parameter(torch.empty(hidden, n, dtype=dtype), requires_grad=False),
                "gate": nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)})

    def quantize(self, kind: str) -> None:
        """Hold every expert's projections as ``kind`` ("int8" / "int4"), dropping the fp
        ones: ``gate_up`` / ``down`` become lists of ``QuantizedWeight`` (indexed by expert
        as the stacked tensors were)."""
        gate_up = [quantize(w, kind) for w in self.gate_up]
        down = [quantize(w, kind) for w in self.down]
        del self.gate_up, self.down  # registered parameters: replaced by plain lists
        self.gate_up: list[QuantizedWeight] | torch.Tensor = gate_up
        self.down: list[QuantizedWeight] | torch.Tensor = down
        if self.shared is not None:
            s = self.shared
            shared = {"gate_up": quantize(s["gate_up"], kind), "down": quantize(s["down"], kind),
                      "gate": s["gate"]}
            del self.shared
            self.shared = shared

    def place(self, place, prefix: str) -> None:
        """Quantized experts (and shared expert) through ``place(weight, name)``
        (``engine.models.quantized.placer``); fp ones move with the module."""
        if not isinstance(self.down, list):
            return
        self.gate_up = [place(w, f"{prefix}experts.{j}.gate_up")
                        for j, w in enumerate(self.gate_up)]
        self.down = [place(w, f"{prefix}experts.{j}.down") for j, w in enumerate(self.down)]
        if isinstance(self.shared, dict):
            self.shared = {k: place(v, f"{prefix}shared_expert.{k}")
                           for k, v in self.shared.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = linear(cpu_ops.silu_mul(linear(x[rows], self.gate_up[e])), self.down[e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            s = self.shared
            y = linear(cpu_ops.silu_mul(linear(x, s["gate_up"])), s["down"])
            out += torch.sigmoid(linear(x, s["gate"])) * y
        return out

    def load(self, take, prefix: str, names: tuple[str, str, str], put,
             quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Fill from HF tensors ``{prefix}gate.weight`` (the router) and, per expert j,
        ``{prefix}experts.{j}.{gate,up,down}.weight`` under the family's ``names`` (and
        Qwen2-MoE's ``shared_expert.*``). ``quantized``: projections already in an
        ``engine.quant.layouts`` layout (a GGUF's blocks), held as they are when every expert's (or
        the shared expert's) are in one layout, else dequantized into the stacked tensors;
        what is not there comes from ``take``."""
        quantized = quantized or {}

        def fp(name: str) -> torch.Tensor:
            q = quantized.get(name)
            return take(name) if q is None else q.dequantize(self.router.dtype)

        put(self.router, take(prefix + "gate.weight"), prefix + "gate.weight")
        experts = [tuple(f"{prefix}experts.{j}.{n}.weight" for n in names)
                   for j in range(len(self.gate_up))]
        held = _one_layout(quantized, [n for parts in experts for n in parts])
        if held is not None:
            self._hold(held, experts)
        else:
            for j, (gate, up, down) in enumerate(experts):
                put(self.gate_up[j], torch.cat([fp(gate), fp(up)]),
                    f"{prefix}experts.{j}.{{{names[0]},{names[1]}}}.weight")
                put(self.down[j], fp(down), down)
        if self.shared is not None:
            p = prefix + "shared_expert."
            gate, up, down = (p + n for n in ("gate_proj.weight", "up_proj.weight",
                                              "down_proj.weight"))
            put(self.shared["gate"], take(prefix + "shared_expert_gate.weight"),
                prefix + "shared_expert_gate.weight")
            held = _one_layout(quantized, [gate, up, down])
            if held is not None:
                gate_up = cat_rows([held[gate], held[up]])
                _check_shape(gate_up, self.shared["gate_up"], p + "{gate,up}_proj.weight")
                _check_shape(held[down], self.shared["down"], down)
                shared = {"gate_up": gate_up, "down": held[down], "gate": self.shared["gate"]}
                del self.shared  # a registered ParameterDict: replaced by a plain dict
                self.shared = shared
            else:
                put(self.shared["gate_up"], torch.cat([fp(gate), fp(up)]),
                    p + "{gate,up}_proj.weight")
                put(self.shared["down"], fp(down), down)

    def _hold(self, held: dict[str, QuantizedWeight],
              experts: list[tuple[str, str, str]]) -> None:
        """Hold every expert's quantized projections as they are (as ``quantize`` leaves
        them): ``gate_up`` / ``down`` become lists indexed by expert."""
        gate_up = [cat_rows([held[g], held[u]]) for g, u, _ in experts]
        down = [held[d] for _, _, d in experts]
        for j, (g, _, d) in enumerate(experts):
            _check_shape(gate_up[j], self.gate_up[j], g.replace(".weight", "+up.weight"))
            _check_shape(down[j], self.down[j], d)
        del self.gate_up, self.down
        self.gate_up = gate_up
        self.down = down


def _one_layout(quantized: dict[str, QuantizedWeight],
                names: list[str]) -> dict[str, QuantizedWeight] | None:
    """``names``' quantized weights when every one is there in one layout, else None."""
    parts = [quantized.get(n) for n in names]
    if not all(parts) or len({(q.kind, q.group) for q in parts}) != 1:
        return None
    return dict(zip(names, parts, strict=True))


def _check_shape(q: QuantizedWeight, like: torch.Tensor, name: str) -> None:
    if q.shape != tuple(like.shape):
        raise ValueError(f"tensor {name!r} has shape {q.shape}, expected "
                         f"{tuple(like.shape)} from config.json")
