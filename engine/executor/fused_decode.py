"""Where a pure-decode step runs as one call of the whole-step decode kernel (``FusedDecodePlan``).

At small batches a decode step streams the weights in ~20 ms on two cores, and the
layer-by-layer path adds a Python call, an allocation and an OpenMP wake-up per op, about ten
per layer. ``engine.ops.cpu_ops.decode_layers`` runs every layer of a pure-decode step in one C
call and one OpenMP region instead. Whether that wins depends on the host: its GEMV is a plain
loop, while the layer-by-layer path may run a library GEMM the host does better. So the engine
times both per batch bucket at start-up (``engine.tuning.fused_decode``) and the runner takes the
fused step where it won. The fused call has two sets of projection tiles, timed as two steps:
dot products (a few weight rows against a few input rows, summed across the vector at the end)
and wide tiles (the batch's rows in vector lanes, each weight scalar broadcast against them: no
horizontal sums, ~2x the FMA rate from ~8 rows on a 2-core AVX-512 EPYC, where a 32-row step
went from 40-44 to 24-27 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.ops import cpu_ops
from engine.tuning.cache import Timing

FUSED_BUCKETS = (1, 2, 4, 8, 16, 32)  # batch buckets timed; larger batches run layer by layer


# How a pure-decode step runs: the layers one by one, or one decode_layers call with its
# projections on the dot-product tiles ("fused") or on the wide tiles ("wide": the batch's rows
# in vector lanes, weights broadcast; ~1.6x the dot tiles' speed at 32 rows on a 2-core EPYC),
# or, for quantized weights, on the integer products ("qint": each projection's input
# quantized to int8 per 32 values; "qamx": the same on AMX tiles where the host runs them,
# engine.ops.cpu_ops.amx_tiles), or on the wide tiles with each tile of quantized weight rows
# expanded to fp32 as it is reached ("qwide": fp32's multiply rate at large batch, the
# quantized bytes read), or the integer products on the weights repacked in panels of 16 rows
# ("qpanel": the rows in the vector lanes, no horizontal sums; AVX-512 VNNI hosts,
# engine.ops.cpu_ops.panels_built).
STEPS = ("layers", "fused", "wide", "qint", "qamx", "qwide", "qpanel")


@dataclass
class FusedDecodePlan:
    """Per batch bucket, how pure-decode steps run (one of ``STEPS``). Empty (untuned): layer
    by layer. ``timings``: one ``Timing`` per bucket, ``m`` the bucket, median seconds per step
    of each of ``STEPS``."""

    choices: dict[int, str] = field(default_factory=dict)
    timings: list[Timing] = field(default_factory=list)
    from_cache: bool = False

    @classmethod
    def everywhere(cls, step: str = "fused") -> FusedDecodePlan:
        """``step`` (``"fused"`` or ``"wide"``) at every bucket, untimed (tests of the kernel,
        A/B in benchmarks)."""
        return cls(dict.fromkeys(FUSED_BUCKETS, step))

    def step(self, batch: int) -> str:
        """How a pure-decode step of ``batch`` sequences runs: its bucket's choice (the largest
        bucket <= batch); ``"layers"`` past the last bucket or where untuned."""
        if batch < 1 or batch > FUSED_BUCKETS[-1]:
            return "layers"
        return self.choices.get(max(b for b in FUSED_BUCKETS if b <= batch), "layers")

    def use(self, batch: int) -> bool:
        """Whether a pure-decode step of ``batch`` sequences is one ``decode_layers`` call."""
        return self.step(batch) != "layers"

    def int_products(self, batch: int) -> bool:
        """Whether a fused step of ``batch`` sequences multiplies quantized weights by int8
        activations (``decode_layers``' integer products)."""
        return self.step(batch) in ("qint", "qamx", "qpanel")

    def amx_tiles(self, batch: int) -> bool:
        """Whether a fused step of ``batch`` sequences runs its integer products on AMX
        tiles."""
        return self.step(batch) == "qamx"

    def panels(self, batch: int) -> bool:
        """Whether a fused step of ``batch`` sequences runs its integer products on the
        weights' panels."""
        return self.step(batch) == "qpanel"

    def wide_from(self, batch: int) -> int:
        """``decode_layers``' ``wide_from`` for a step of ``batch`` sequences."""
        return 1 if self.step(batch) in ("wide", "qwide") else cpu_ops.NEVER_WIDE

    def summary(self) -> list[str]:
        """One line per bucket: the choice and each step's time (``pdcluster bench ceilings``)."""
        lines = []
        for t in sorted(self.timings, key=lambda t: t.m):
            s = t.seconds
            times = ", ".join(f"{s[k] * 1e3:.1f} ms {_LABELS[k]}" for k in STEPS if k in s)
            lines.append(f"batch {t.m}: {t.best} step ({times}: "
                         f"{s['layers'] / s[t.best]:.2f}x the layers)")
        return lines


_LABELS = {"layers": "layer by layer", "fused": "fused, dot tiles", "wide": "fused, wide tiles",
           "qint": "fused, integer products", "qamx": "fused, integer products on AMX tiles",
           "qwide": "fused, wide tiles on expanded weights",
           "qpanel": "fused, integer products on weight panels"}
