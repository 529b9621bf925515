"""The decoder every family shares, over a paged KV cache: Llama and SmolLM as the base;
Qwen2 (qkv bias), Qwen3 (per-head q/k norms), Mistral and Phi-3 (fused checkpoint tensors)
as fields of it; what the others change in their own files: routed experts (Mixtral,
Qwen2/3-MoE: ``engine.models.moe``), Gemma 2/3's norms and GeGLU (``engine.models.gemma``),
and every RoPE variant (``engine.models.rope``). Per-layer sliding windows and soft-capped
scores live in the attention backends (``AttentionShape``).

Tokens of all sequences in a step are flattened into one ``[num_tokens]`` batch, so every
linear layer runs once per step for the whole batch (the batching gain on memory-bound decode).
Q/K/V and gate/up are fused into single GEMMs: on CPU small-M GEMMs are far below the roof, and
fewer, wider ones are measurably faster (docs/benchmarks.md). Every projection goes through
``engine.ops.linear.linear``, whose path per weight shape and batch size was timed on this host;
the norms, rotary embedding and SiLU-gate go through ``engine.ops.cpu_ops`` (fused C kernels on
fp32 CPU, their torch twins elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.lora.rows import active as active_lora
from engine.models.config import ModelConfig
from engine.models.fused_step import FusedDecodeStep
from engine.models.gemma import gelu_tanh_mul, load_norms, norm_weight
from engine.models.moe import SparseMoE
from engine.models.quantized import QEmbedding, QLinear, placer
from engine.models.rope import RotaryEmbedding
from engine.ops import cpu_ops
from engine.ops.linear import linear
from engine.parallel.sharding import TPShard
from engine.quant.gpu import TinyGemmWeight, to_cuda
from engine.quant.layouts import QuantizedWeight, cat_rows, quantize

if TYPE_CHECKING:
    from engine.parallel.comm import TPComm

LayerHook = Callable[[int, torch.Tensor], None]


# The weights are made without values (torch.empty): every one is loaded from the checkpoint
# (``load_hf_state_dict`` refuses a missing tensor). nn.Linear / nn.Embedding initialize
# theirs, which wrote every page of the fp weights (a quantized load then threw them away,
# and the process's peak memory held a whole fp copy it never used); made on the meta device
# instead, their initializers imported ~900 modules (150 MB).
class Linear(nn.Module):
    """A linear layer's weight ``[out, in]`` (and bias), uninitialized; read by
    ``engine.ops.linear.linear``, never called."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)


class Embedding(nn.Module):
    """The token embedding ``[vocab, hidden]``, uninitialized."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class DecoderLayer(nn.Module):
    """One layer; ``cfg`` holds this rank's shapes (``TPShard.local_config``). With a
    tensor-parallel ``comm``, O and down are row-parallel: their partial sums are all-reduced
    before the residual add."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 comm: TPComm | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.comm = comm
        self.layer_idx = layer_idx  # passed to the attention backend, which may keep per-layer state
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        # The norm before the feed-forward (HF: post_attention_layernorm; Gemma:
        # pre_feedforward_layernorm).
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        # Gemma: norms of the attention's and the feed-forward's outputs, before each residual add.
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.sandwich_norms:
            self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype),
                                              requires_grad=False)
            self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype),
                                             requires_grad=False)
        # Gemma's attention scale (query_pre_attn_scalar ** -0.5) folded into the queries, so
        # every attention kernel keeps its 1/sqrt(head_dim): q * f . k / sqrt(D) = q . k * scale.
        self.q_factor = (None if cfg.attn_scale is None
                         else cfg.attn_scale * cfg.head_dim ** 0.5)
        # Gemma 3: sliding layers rotate with their own RoPE base (the model's second table).
        self.local_rope = cfg.local_rope_theta is not None and cfg.layer_window(layer_idx) is not None
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, False, dtype)
        # The feed-forward: one SwiGLU MLP, or routed experts (Mixtral, Qwen3-MoE).
        self.moe = SparseMoE(cfg, dtype) if cfg.num_experts else None
        if self.moe is None:
            self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype)
            self.down = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)
        # Qwen3: one RMSNorm weight [head_dim] shared by every query head, one by every key head
        # (replicated under tensor parallelism: it is per head, not per head index).
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype), requires_grad=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        x = cpu_ops.rms_norm(h, self.input_norm, cfg.rms_norm_eps)
        qkv = self._proj("qkv", x)  # [T, (H + 2 KVH) * D]
        if self.q_norm is not None:
            self._norm_qk_heads(qkv)
        q, k = rope.apply_qk(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cos, sin)
        if self.q_factor is not None:
            q.mul_(self.q_factor)  # this layer's own tensor (a view of qkv, or rope's output)
        v = qkv[:, self.q_size + self.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        o = attn.forward(self.layer_idx, q, k, v, kv_cache)  # [T, H * D]
        o = self._proj("o_proj", o)
        if self.comm is not None:
            self.comm.all_reduce(o)
        if self.attn_out_norm is not None:
            o = cpu_ops.rms_norm(o, self.attn_out_norm, cfg.rms_norm_eps)
        # h is this layer's own tensor (the embedding's output or the previous layer's sum),
        # so the skip connection may add into it in place.
        h, x = cpu_ops.add_rms_norm(h, o, self.post_norm, cfg.rms_norm_eps)
        if self.moe is not None:
            m = self.moe(x)
        else:
            gu = self._proj("gate_up", x)
            m = self._proj("down", cpu_ops.silu_mul(gu) if cfg.hidden_act == "silu"
                           else gelu_tanh_mul(gu))
        if self.comm is not None:
            self.comm.all_reduce(m)
        if self.mlp_out_norm is not None:
            m = cpu_ops.rms_norm(m, self.mlp_out_norm, cfg.rms_norm_eps)
        return h + m

    def _proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Projection ``name`` of ``x``, plus the LoRA adapters' share where the step runs
        rows under adapters (``engine.lora.rows``)."""
        lin = getattr(self, name)
        y = linear(x, lin.weight, lin.bias)
        lora = active_lora()
        if lora is not None:
            lora.add(self.layer_idx, name, x, y)
        return y

    def _norm_qk_heads(self, qkv: torch.Tensor) -> None:
        """Qwen3: RMSNorm each query and key head of ``qkv`` in place (before RoPE)."""
        cfg, t, d = self.cfg, qkv.shape[0], self.cfg.head_dim
        q = qkv[:, :self.q_size].reshape(t * cfg.num_heads, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(t * cfg.num_kv_heads, d)
        qkv[:, :self.q_size] = cpu_ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps).view(t, -1)
        qkv[:, self.q_size:self.q_size + self.kv_size] = cpu_ops.rms_norm(
            k, self.k_norm, cfg.rms_norm_eps).view(t, -1)


class LlamaForCausalLM(FusedDecodeStep, nn.Module):
    """The decoder. ``forward`` returns hidden states; ``compute_logits`` the vocabulary scores.

    With a tensor-parallel ``comm`` this is one rank's shard (``engine.parallel.sharding``):
    ``cfg`` becomes the rank's shapes (its heads, KV heads and intermediate size: what the
    runner sizes attention and the KV cache by), the LM head holds the rank's vocabulary rows,
    and every rank must run the same calls in the same order (they meet in collectives)."""

    def __init__(self, cfg: ModelConfig, max_len: int | None = None,
                 comm: TPComm | None = None) -> None:
        super().__init__()
        dtype = getattr(torch, cfg.dtype)
        self.shard = comm.shard if comm is not None else TPShard()
        self.shard.check(cfg)
        self.comm = comm if self.shard.size > 1 else None
        self.full_cfg = cfg
        self.vocab = self.shard.vocab(cfg)
        cfg = self.shard.local_config(cfg)
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i, self.comm)
                                    for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        # Tied at tensor parallelism: this rank's rows of the (replicated) embedding.
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, len(self.vocab), False, dtype))
        self.rope = RotaryEmbedding(cfg, max_len or cfg.max_model_len, dtype)
        # Buffers, so `.to(device)` moves the tables with the weights.
        self.register_buffer("rope_cos", self.rope.cos, persistent=False)
        self.register_buffer("rope_sin", self.rope.sin, persistent=False)
        self.rope_local = None  # Gemma 3: the sliding layers' tables
        if any(layer.local_rope for layer in self.layers):
            self.rope_local = RotaryEmbedding(cfg, max_len or cfg.max_model_len, dtype, local=True)
            self.register_buffer("rope_local_cos", self.rope_local.cos, persistent=False)
            self.register_buffer("rope_local_sin", self.rope_local.sin, persistent=False)
        windows = [w for w in cfg.layer_windows if w is not None]
        self._min_window = min(windows) if windows else None  # decode_fused's limit
        # Gemma: embeddings times sqrt(hidden), rounded to the model dtype as transformers does.
        # A buffer: `.to(device)` moves it with the weights (no host-to-device copy a step).
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)
                             if cfg.embed_scale else None, persistent=False)
        self.requires_grad_(False)
        # decode_layers' table: its key, its tensors, the table, the projections' layout
        self._pointers: tuple | None = None  # FusedDecodeStep's address tables
        self._panel_table: tuple | None = None
        # The quantized layouts serving the linear layers: "int8" | "int4" once ``quantize``
        # ran, or what a GGUF's blocks loaded as ("int4+int8"); None: all in the model dtype.
        self.quantization: str | None = None
        # int4 on CUDA with a tied head: the table packed for tinygemm (place_quantized), the
        # embedding's rows still looked up from ``self.embed``
        self._tied_head: TinyGemmWeight | None = None
        self.layer_shapes = cpu_ops.DecodeLayerShapes(cfg.hidden_size, cfg.num_heads,
                                                      cfg.num_kv_heads, cfg.head_dim,
                                                      cfg.intermediate_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: AttentionBackend, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: ``[T]``; ``attn`` is already planned for this step.
        ``layer_hook(i, kv_cache_i)`` runs after layer i's KV is written (the prefill worker
        streams that layer out while the next one computes)."""
        h = self.embed(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            h.mul_(self.embed_scale)  # the embedding's output is a new tensor: ours to scale
        cos = self.rope_cos[positions]  # [T, D]
        sin = self.rope_sin[positions]
        local = ((self.rope_local_cos[positions], self.rope_local_sin[positions])
                 if self.rope_local is not None else None)
        for i, layer in enumerate(self.layers):
            c, s = local if layer.local_rope else (cos, sin)
            h = layer(h, c, s, self.rope, kv_caches[i], attn)
            if layer_hook is not None:
                layer_hook(i, kv_caches[i])
        return cpu_ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in fp32 (sampling math is fp32 whatever the model
        dtype); under tensor parallelism every rank gets the whole rows (all-gathered)."""
        if self.lm_head is not None:
            w = self.lm_head.weight
        elif self._tied_head is not None:
            w = self._tied_head
        else:
            w = self.embed.weight
            if self.comm is not None:
                w = (w.row_slice(self.vocab.start, self.vocab.stop)
                     if isinstance(w, QuantizedWeight) else w[self.vocab.start:self.vocab.stop])
        logits = linear(hidden, w).float()
        cap = self.cfg.final_softcap
        if cap is not None:  # Gemma 2: tanh soft-capping, elementwise (before the gather too)
            logits = torch.tanh(logits / cap) * cap
        if self.comm is None:
            return logits
        per = self.shard.vocab_per_rank(self.full_cfg)
        if logits.shape[1] < per:  # the last rank's short slice: padded, then cut off
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[1]))
        return self.comm.all_gather(logits)[:, :self.full_cfg.vocab_size]

    def quantize(self, kind: str) -> None:
        """Replace every linear weight (QKV, O, gate/up, down or every expert's, the LM head,
        and the embedding where the head is tied to it) by its ``engine.quant.layouts`` layout
        ``kind`` ("int8" or "int4"), dropping the fp tensors: what ``--quantization`` does
        after loading. Norms, biases, MoE routers and the KV cache stay in the model dtype.
        Raises ValueError for layouts a weight cannot take."""
        if self.quantization:
            raise ValueError(f"the model is already quantized ({self.quantization})")
        for layer in self.layers:
            for name in ("qkv", "o_proj") if layer.moe is not None else (
                    "qkv", "o_proj", "gate_up", "down"):
                lin = getattr(layer, name)
                setattr(layer, name, QLinear(quantize(lin.weight, kind), lin.bias))
            if layer.moe is not None:
                layer.moe.quantize(kind)
        if self.lm_head is not None:
            self.lm_head = QLinear(quantize(self.lm_head.weight, kind), None)
        else:  # tied: the head is the embedding (under TP each rank's rows of it)
            self.embed = QEmbedding(quantize(self.embed.weight, kind))
        self._pointers = None
        self.quantization = kind

    def place_quantized(self, device: torch.device) -> None:
        """Move the quantized weights to ``device`` (``Module.to`` moves parameters and
        buffers; these are neither). On CUDA, int4 projections are packed for PyTorch's
        tinygemm kernel (``engine.quant.gpu``), every expert's too, and a tied head gets a
        packed copy of the table beside the embedding's rows. Nothing to do on the CPU."""
        if not self.quantization or device.type == "cpu":
            return
        place = placer(device)
        for i, layer in enumerate(self.layers):
            for attr in ("qkv", "o_proj", "gate_up", "down"):
                lin = getattr(layer, attr, None)
                if isinstance(lin, QLinear):
                    lin.weight = place(lin.weight, f"layers.{i}.{attr}")
            if layer.moe is not None:
                layer.moe.place(place, f"layers.{i}.")
        if isinstance(self.lm_head, QLinear):
            self.lm_head.weight = place(self.lm_head.weight, "lm_head")
        if isinstance(self.embed, QEmbedding):
            table = self.embed.weight
            if self.lm_head is None and table.kind == "int4" and self.comm is None:
                head = to_cuda(table, device, "lm_head (tied)")
                self._tied_head = head if isinstance(head, TinyGemmWeight) else None
            self.embed.weight = table.to(device)
        self._pointers = None

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor],
                           quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up. Under tensor
        parallelism ``sd`` holds this rank's slices (``load_state_dict(..., shard=...)``).
        ``quantized``: linear weights (and the embedding) already in an ``engine.quant.layouts``
        layout (a GGUF's own blocks, ``engine.weights.loader.load_quantized_state_dict``), served as
        they are; a fused weight whose parts do not share one layout is dequantized instead
        (exact, in the model dtype). Raises ValueError on a missing or mis-shaped tensor (the
        checkpoint does not match the config)."""
        dtype = self.embed.weight.dtype
        quantized = quantized or {}
        gemma = self.cfg.sandwich_norms

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return sd[name].to(dtype)

        def take_norm(name: str) -> torch.Tensor:
            """An RMSNorm weight as applied (Gemma's: 1 + w, ``engine.models.gemma``)."""
            if name not in sd:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return norm_weight(sd[name], dtype) if gemma else sd[name].to(dtype)

        def take_linear(names: list[str]) -> torch.Tensor | QuantizedWeight:
            """The named parts of one fused weight, stacked by rows: quantized where every
            part is in one layout, else in ``dtype``."""
            parts = [quantized.get(n) for n in names]
            if all(parts) and len({(q.kind, q.group) for q in parts}) == 1:
                return parts[0] if len(parts) == 1 else cat_rows(parts)
            return torch.cat([parts[i].dequantize(dtype) if parts[i] is not None
                              else take(n) for i, n in enumerate(names)])

        def put_linear(owner: nn.Module, attr: str, names: list[str], label: str) -> None:
            w = take_linear(names)
            if isinstance(w, QuantizedWeight):
                lin = getattr(owner, attr)
                if w.shape != tuple(lin.weight.shape):
                    raise ValueError(f"tensor {label!r} has shape {w.shape}, expected "
                                     f"{tuple(lin.weight.shape)} from config.json")
                setattr(owner, attr, QLinear(w, lin.bias))
            else:
                put(getattr(owner, attr).weight, w, label)

        def put(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if dst.shape != src.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)} from config.json")
            dst.copy_(src)

        embed = quantized.get("model.embed_tokens.weight")
        if embed is not None and self.comm is None:
            if embed.shape != tuple(self.embed.weight.shape):
                raise ValueError(f"tensor 'model.embed_tokens.weight' has shape {embed.shape}, "
                                 f"expected {tuple(self.embed.weight.shape)} from config.json")
            self.embed = QEmbedding(embed)
        else:
            put(self.embed.weight, embed.dequantize(dtype) if embed is not None
                else take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take_norm("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            if "lm_head.weight" in sd or "lm_head.weight" in quantized:
                put_linear(self, "lm_head", ["lm_head.weight"], "lm_head.weight")
            else:  # the embedding is loaded whole: take this rank's rows
                rows = (self.embed.weight.dequantize(dtype)
                        if isinstance(self.embed.weight, QuantizedWeight)
                        else take("model.embed_tokens.weight"))
                put(self.lm_head.weight, rows[self.vocab.start:self.vocab.stop],
                    "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(layer.input_norm, take_norm(p + "input_layernorm.weight"),
                p + "input_layernorm.weight")
            if gemma:  # norms on both sides of attention and of the MLP
                load_norms(layer, p, take_norm, put)
            else:
                put(layer.post_norm, take(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm.weight")
            if a + "qkv_proj.weight" in sd or a + "qkv_proj.weight" in quantized:
                # Phi-3 ships them fused, in our order
                put_linear(layer, "qkv", [a + "qkv_proj.weight"], a + "qkv_proj.weight")
            else:
                put_linear(layer, "qkv", [a + "q_proj.weight", a + "k_proj.weight",
                                          a + "v_proj.weight"], a + "{q,k,v}_proj.weight")
            if layer.qkv.bias is not None:
                bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                  take(a + "v_proj.bias")])
                put(layer.qkv.bias, bias, a + "{q,k,v}_proj.bias")
            put_linear(layer, "o_proj", [a + "o_proj.weight"], a + "o_proj.weight")
            if layer.q_norm is not None:
                put(layer.q_norm, take_norm(a + "q_norm.weight"), a + "q_norm.weight")
                put(layer.k_norm, take_norm(a + "k_norm.weight"), a + "k_norm.weight")
            if layer.moe is not None:
                if self.cfg.architecture == "mixtral":
                    layer.moe.load(take, p + "block_sparse_moe.", ("w1", "w3", "w2"), put,
                                   quantized)
                else:
                    layer.moe.load(take, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), put,
                                   quantized)
                continue
            m = p + "mlp."
            if m + "gate_up_proj.weight" in sd or m + "gate_up_proj.weight" in quantized:
                # Phi-3: [gate | up] already
                put_linear(layer, "gate_up", [m + "gate_up_proj.weight"], m + "gate_up_proj.weight")
            else:
                put_linear(layer, "gate_up", [m + "gate_proj.weight", m + "up_proj.weight"],
                           m + "{gate,up}_proj.weight")
            put_linear(layer, "down", [m + "down_proj.weight"], m + "down_proj.weight")
        kinds = {m.weight.kind for m in self.modules() if isinstance(m, QLinear | QEmbedding)}
        kinds |= {w.kind for layer in self.layers if layer.moe is not None
                  for w in layer.moe.down if isinstance(w, QuantizedWeight)}
        if kinds:
            self.quantization = "+".join(sorted(kinds))
            self._pointers = None
