"""What per-request tracing costs a served load: `pdcluster bench serve` against `pdcluster
serve` with tracing off and with every request traced, in one run.

    python -m bench.studies.tracing_cost [--rounds 5] [--rates 2,inf] [--num-prompts 32]

Each round starts the server twice, tracing off and on, in alternating order
(``bench.harness.serve_ab``): the default disaggregated cluster, loaded over gRPC, exporting
(when on) to an OTLP/gRPC receiver in this process at a sample ratio of 1 — the collector
shares the box, the worst case. Reports, per rate, the medians over rounds of output
throughput and TPOT p50 for both, their ratios (on / off), and the spans received; writes
``tracing_cost.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness.otlp_receiver import OtlpReceiver
from bench.harness.serve_ab import Load, run_ab

NAME = "tracing_cost"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rates", default="2,inf")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    from bench.harness.report import machine_info, write_json

    load = Load(args.rates, args.num_prompts, args.input_len, args.output_len)
    otlp = OtlpReceiver().start()
    try:
        result = run_ab({"off": [], "on": ["--otlp-traces-endpoint", otlp.endpoint]}, load,
                        args.rounds)
    finally:
        otlp.stop()
    spans = otlp.spans()
    for cell in result["cells"].values():
        on, off = cell["on"], cell["off"]
        cell["throughput_on_over_off"] = on["output_throughput_tok_s"] / off["output_throughput_tok_s"]
        cell["tpot_p50_on_over_off"] = on["tpot_p50_s"] / off["tpot_p50_s"]
    result.update({"benchmark": NAME, "load": asdict(load), "spans_received": len(spans),
                   "traces_received": len({s.trace_id for s in spans}),
                   "machine": machine_info()})
    path = write_json(Path(args.out), NAME, result)
    for rate, c in result["cells"].items():
        print(f"  rate {rate}: output {c['off']['output_throughput_tok_s']:.1f} -> "
              f"{c['on']['output_throughput_tok_s']:.1f} tok/s "
              f"({c['throughput_on_over_off']:.3f}x), TPOT p50 "
              f"{c['off']['tpot_p50_s'] * 1e3:.1f} -> {c['on']['tpot_p50_s'] * 1e3:.1f} ms "
              f"({c['tpot_p50_on_over_off']:.3f}x)")
    print(f"  {result['traces_received']} traces, {result['spans_received']} spans received")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
