"""How fast the quantized C kernels read weights: one pass over the default model's
projection shapes (x30 layers) through ``engine.ops.quant_ops.quantized_linear`` for int8 and
int4, beside torch's fp32 ``F.linear`` on the same shapes, at a batch of ``--rows``; median of
11 interleaved rounds, in ms and G weights/s.

Run: ``python -m bench.studies.quant_linear [--threads 2] [--rows 1]``. To compare two builds
of ``engine/ops/csrc/cpu_ops.c`` (the library is rebuilt when the source changes), run it once per
build, alternating, several times: a shared VM's spells move single runs by 1.3x.
"""

from __future__ import annotations

import argparse
import statistics
import time

# The default model's linear weights per layer: QKV, O, gate/up, down ([out, in]).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def main() -> None:
    import torch

    from engine.ops.quant_ops import quantized_linear
    from engine.quant.layouts import quantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = SHAPES * LAYERS
    weights = {"fp32": [torch.randn(n, k) for n, k in shapes]}
    for kind in ("int8", "int4"):
        weights[kind] = [quantize(w, kind) for w in weights["fp32"]]
    xs = {k: torch.randn(args.rows, k) for k in {k for _, k in SHAPES}}

    def one_pass(kind: str) -> float:
        t0 = time.perf_counter()
        for w in weights[kind]:
            x = xs[w.shape[1]]
            if kind == "fp32":
                torch.nn.functional.linear(x, w)
            else:
                quantized_linear(x, w, None)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in weights}
    for r in range(12):  # round 0 warms up, untimed
        for kind in weights:
            t = one_pass(kind)
            if r:
                times[kind].append(t)
    count = sum(n * k for n, k in shapes)
    print(f"{args.rows} row(s), {args.threads} thread(s), {count / 1e6:.0f} M weights a pass")
    for kind, ts in times.items():
        t = statistics.median(ts)
        print(f"  {kind}: {t * 1e3:.2f} ms, {count / t / 1e9:.1f} G weights/s")


if __name__ == "__main__":
    main()
