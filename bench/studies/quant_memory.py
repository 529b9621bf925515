"""What each ``--quantization`` holds in memory: the default model (or ``--model``) loaded
the way an engine loads it, in a fresh process per layout, reporting the process's peak RSS
and the bytes of the weights it ended with (linear layers, embedding, everything else).

Run: ``python -m bench.studies.quant_memory`` (the GGUF conversion is made first, in its own
process, so no layout's peak includes it). Prints a table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

LAYOUTS = ("none", "int8", "int4", "gguf")


def measure(model: str | None, quantization: str) -> dict:
    """In this process: resolve, build, load like ``LLMEngine`` (no KV pool, no tuning)."""
    import torch

    from engine.models.llama import LlamaForCausalLM
    from engine.quant.layouts import QuantizedWeight, check_quantization
    from engine.weights.loader import load_weights
    from engine.weights.resolve import load_model_config, resolve_model

    torch.set_num_threads(1)
    before = _status_kib("VmHWM")
    resolved = resolve_model(model)
    cfg = load_model_config(resolved.model_dir, model_id=resolved.model_id)
    check_quantization(quantization, torch.device("cpu"))
    net = LlamaForCausalLM(cfg)
    load_weights(net, resolved.model_dir, quantization)
    quantized = fp = 0
    for mod in net.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, QuantizedWeight):
            quantized += w.nbytes
    fp = sum(p.numel() * p.element_size() for p in net.parameters())
    peak, now = _status_kib("VmHWM"), _status_kib("VmRSS")
    return {"quantization": quantization, "layouts": net.quantization or "fp32",
            "quantized_weight_bytes": quantized, "fp_weight_bytes": fp,
            "peak_rss_bytes": peak * 1024, "rss_after_load_bytes": now * 1024,
            "rss_before_model_bytes": before * 1024}


def _status_kib(field: str) -> int:
    """A /proc/self/status figure in KiB: VmHWM is this process's own peak (getrusage's
    ru_maxrss survives exec, so a child started from a large parent reports the parent's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the default GGUF)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's own run
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.model, args.one)))
        return []
    from engine.weights.resolve import resolve_model

    resolve_model(args.model)  # the conversion, outside every measured process
    rows = []
    for layout in args.layouts.split(","):
        cmd = [sys.executable, "-m", "bench.studies.quant_memory", "--one", layout]
        if args.model:
            cmd += ["--model", args.model]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    mib = 1 << 20
    print(f"{'layout':>6} {'served as':>10} {'quantized MiB':>13} {'fp MiB':>7} "
          f"{'peak RSS MiB':>12} {'RSS after MiB':>13} {'before model':>12}")
    for r in rows:
        print(f"{r['quantization']:>6} {r['layouts']:>10} {r['quantized_weight_bytes'] / mib:>13.1f} "
              f"{r['fp_weight_bytes'] / mib:>7.1f} {r['peak_rss_bytes'] / mib:>12.0f} "
              f"{r['rss_after_load_bytes'] / mib:>13.0f} {r['rss_before_model_bytes'] / mib:>12.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
