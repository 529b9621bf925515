"""The decoder's side of the whole-step decode kernel (``engine.ops.cpu_ops.decode_layers``):
``FusedDecodeStep``, mixed into ``engine.models.llama.LlamaForCausalLM``, runs a pure-decode step
as one C call and keeps the kernel's address table of every layer's tensors (and, for the
integer products on panels, of the projections' panels) in step with the model's weights."""

from __future__ import annotations

import torch

from engine.ops import cpu_ops, quant_ops
from engine.quant.layouts import QuantizedWeight


class FusedDecodeStep:
    """``decode_fused`` and its address tables, for a model with ``cfg``, ``comm``,
    ``layers`` (each with ``qkv``, ``o_proj``, ``gate_up``, ``down``, the norms),
    ``embed``, ``norm``, ``layer_shapes``, ``rope_cos`` / ``rope_sin`` and ``_min_window``;
    ``_pointers`` and ``_panel_table`` start as None and are reset to None whenever the
    weights change (quantization, placement, loading)."""

    _pointers: tuple | None = None
    _panel_table: tuple | None = None  # (the _pointers it follows, rows, table)

    def decode_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[torch.Tensor], tables: torch.Tensor, kv_lens: torch.Tensor,
                     block_size: int, wide_from: int = cpu_ops.NEVER_WIDE,
                     int_products: bool = False, amx: bool = False,
                     panels: bool = False, lora=None) -> torch.Tensor | None:
        """``forward`` for a pure-decode step (one new token per sequence, ``input_ids [M]``)
        as one call of ``engine.ops.cpu_ops.decode_layers``: every layer in one OpenMP region,
        the new K/V written into each sequence's slot (``tables [M, max_pages]``, ``kv_lens
        [M]`` including the new token, int64; from ``wide_from`` rows the kernel's wide tiles;
        ``int_products``: quantized projections against int8 activations, the ``cqint``
        linear path's math, where the weights are in groups of 32; ``amx``: on AMX tiles, the
        ``camx`` path's, where ``cpu_ops.amx_tiles``; ``panels``: the same products on the
        weights repacked in panels, the ``cqpanel`` path's, where ``panels_apply``; ``lora``:
        the step's ``engine.lora.rows.LoRARows``, whose adapters each projection adds, on the
        row-layout tiles: not the wide ones).
        Same math as ``forward``; None, computing
        nothing, where the kernel does not apply (the caller then runs ``forward``)."""
        cfg = self.cfg
        if (self.comm is not None or cfg.num_experts or cfg.sandwich_norms
                or not cpu_ops.decode_layers_applies(self.layer_shapes, self.embed.weight.dtype)):
            # the fused kernel has no all-reduce between layers, no experts, nor Gemma's layer
            return None
        if self._min_window is not None and int(kv_lens.max()) > self._min_window:
            return None  # nor windows: it runs only while every sequence fits in them
        pointers = self._layer_pointers(kv_caches)
        if self._pointers[3] is None:
            return None  # projections in more than one layout (e.g. a GGUF mixing types)
        h = self.embed(input_ids)  # [M, hidden], a new tensor the kernel updates in place
        layout = self._pointers[3]
        if int_products and panels and self.panels_apply():
            # decode_layers' integer products on the weights' panels (7: int8, 8: int4)
            pointers, layout = self._panel_pointers(), (layout[0] + 6, 32)
        elif int_products and layout[0] in (1, 2) and layout[1] == 32:
            # decode_layers' integer products (3: int8, 4: int4; on AMX tiles 5, 6, which the
            # kernel runs as 3, 4 where the process was not granted AMX)
            layout = (layout[0] + (4 if amx else 2), 32)
        ok = cpu_ops.decode_layers(h, pointers, self.layer_shapes, self.rope_cos[positions],
                                   self.rope_sin[positions], tables, kv_lens, block_size,
                                   wide_from, layout, kv_int8=kv_caches[0].dtype == torch.int8,
                                   lora=None if lora is None else lora.kernel_table())
        return cpu_ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps) if ok else None

    def _layer_pointers(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """``decode_layers``' address table, made once per set of KV caches and weights. The
        table's tensors are held with it, so every address in it stays valid memory whatever
        the caller does; it is remade when the KV caches move or the first or last layer's
        tensors are not the ones it holds (weights replaced rather than copied into, e.g. a
        ``load_state_dict(assign=True)``; ``load_hf_state_dict`` copies in place). Checking
        every layer's tensors cost ~190 us a step for the default model (module attribute
        lookups), the two layers ~15. Quantized projections enter the table as their data,
        scales and offsets; ``self._pointers[3]`` is their layout for ``decode_layers``
        (``(0, 0)`` for fp weights), None when the projections mix layouts."""
        def parts(w) -> tuple:  # the weight (or its data) and its scales and offsets
            if isinstance(w, QuantizedWeight):
                return (w.data, w.scale, w.offset)
            return (w, None, None)

        def row(i: int) -> tuple:
            lay = self.layers[i]
            qkv, o, gu, down = (parts(getattr(lay, n).weight)
                                for n in ("qkv", "o_proj", "gate_up", "down"))
            return (lay.input_norm, lay.post_norm, qkv[0], lay.qkv.bias, o[0], gu[0], down[0],
                    lay.q_norm, lay.k_norm, *qkv[1:], *o[1:], *gu[1:], *down[1:])

        key = (tuple(c.data_ptr() for c in kv_caches), row(0), row(-1))
        held = self._pointers
        if (held is None or held[0][0] != key[0]
                or any(a is not b for a, b in zip(held[0][1] + held[0][2], key[1] + key[2],
                                                  strict=True))):
            rows = [(*r[:9], cache, *r[9:]) for r, cache in
                    ((row(i), c) for i, c in enumerate(kv_caches))]
            held = self._pointers = (key, rows, cpu_ops.layer_pointers(rows),
                                     self._projection_layout())
        return held[2]

    def panels_apply(self) -> bool:
        """Whether ``decode_fused`` can run its integer products on the projections' panels
        (``engine.ops.quant_ops.panels``): int8 / int4 in groups of 32 on a host whose build
        has them, the MLP's width a multiple of 16 (a panel holds 16 rows of gate or up,
        never both)."""
        layout = self._projection_layout() if self._pointers is None else self._pointers[3]
        return (layout is not None and layout[0] in (1, 2) and layout[1] == 32
                and self.cfg.intermediate_size % 16 == 0 and cpu_ops.panels_built())

    def _panel_pointers(self) -> torch.Tensor:
        """``_layer_pointers``' table (made first) with each projection's panels for its data
        and no scales (the panels hold them); remade with it."""
        held = self._panel_table
        if held is None or held[0] is not self._pointers:
            rows = []
            for lay, row in zip(self.layers, self._pointers[1], strict=True):
                qkv, o, gu, down = (quant_ops.panels(getattr(lay, n).weight)
                                    for n in ("qkv", "o_proj", "gate_up", "down"))
                rows.append((*row[:2], qkv, row[3], o, gu, down, *row[7:10], *(None,) * 8))
            held = self._panel_table = (self._pointers, rows, cpu_ops.layer_pointers(rows))
        return held[2]

    def _projection_layout(self) -> tuple[int, int] | None:
        """``decode_layers``' ``weights``: (0, 0) when every projection is an fp tensor, (1,
        group) / (2, 32) when all are int8 of one group / int4 (fp32 activations), else None."""
        ws = [getattr(lay, n).weight for lay in self.layers
              for n in ("qkv", "o_proj", "gate_up", "down")]
        quantized = [w for w in ws if isinstance(w, QuantizedWeight)]
        if not quantized:
            return (0, 0)
        layouts = {(w.kind, w.group, w.dtype, w.scale.dtype) for w in quantized}
        if len(quantized) != len(ws) or len(layouts) != 1:
            return None
        kind, group, dtype, scale_dtype = layouts.pop()
        if dtype != torch.float32 or scale_dtype != torch.float16:
            return None
        return (1, group) if kind == "int8" else (2, 32)
