"""Where a decode step's CPU time goes by torch op, and whether the weights stay in cache.

    python -m bench.studies.op_profile [--batch 1] [--steps 10] [--model DIR] [--layer-by-layer]

1. ``torch.profiler`` over ``--steps`` engine decode steps of ``--batch`` sequences (64-token
   seeded prompts, after warm-up): the top ops by self CPU time, the step's wall time, and
   ``aten::mm`` per step with the bandwidth it implies (weight bytes / mm time: at batch 1 a
   step streams every weight once). The fused C kernels are ctypes calls, not torch ops: they
   and the Python between ops are the wall time the table does not account for. Where the
   host runs pure-decode steps as one fused call (``engine.executor.fused_decode``) that call is all
   there is: ``--layer-by-layer`` profiles the op-by-op step instead.
2. One-row passes over the model's linear weights in step order (``engine.tuning.linear.
   time_passes``), with and without the LM head: if the smaller working set streams faster,
   the CPU's cache holds part of the weights across a step; if not, every step reads them all
   from memory.
"""

from __future__ import annotations

import argparse
import random
import time

PROMPT_LEN, WARM_STEPS = 64, 5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.op_profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=15, help="ops listed")
    p.add_argument("--layer-by-layer", action="store_true",
                   help="run the op-by-op step even where the host runs it as one fused call")
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        raise SystemExit("--batch and --steps must be >= 1")

    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams
    from engine.tuning.linear import model_linear_weights, time_passes

    llm = LLM(args.model, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch * PROMPT_LEN))
    eng = llm.engine
    if args.layer_by_layer:
        from engine.executor.fused_decode import FusedDecodePlan

        eng.runner.fused_decode = FusedDecodePlan()
    fused = eng.runner.fused_decode.use(args.batch)
    print(f"decode step: {'one fused call (engine.executor.fused_decode)' if fused else 'layer by layer'}")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=WARM_STEPS + args.steps + 2, temperature=0, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request([rng.randrange(3, eng.model_config.vocab_size) for _ in range(PROMPT_LEN)],
                        params)
    for _ in range(WARM_STEPS):  # the prefill step, then decode steps
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        wall = (time.perf_counter() - t0) / args.steps
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    mm_s = sum(e.self_cpu_time_total for e in averages if e.key == "aten::mm") / 1e6 / args.steps
    torch_s = sum(e.self_cpu_time_total for e in averages) / 1e6 / args.steps
    weights = model_linear_weights(eng.model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"batch {args.batch}: step {wall * 1e3:.2f} ms (under the profiler); torch ops "
          f"{torch_s * 1e3:.2f} ms, of which aten::mm {mm_s * 1e3:.3f} ms "
          f"({nbytes / max(mm_s, 1e-9) / 1e9:.1f} GB/s over {nbytes / 1e6:.0f} MB of linear weights); "
          f"outside torch ops (C kernels, Python) {(wall - torch_s) * 1e3:.1f} ms")

    layers = weights[:-1]
    layer_bytes = nbytes - weights[-1].numel() * weights[-1].element_size()
    for _ in range(2):
        a = time_passes(layers, 1, {}, repeats=8, warm_up=True)
        b = time_passes(weights, 1, {}, repeats=8, warm_up=True)
        print(f"one-row pass (F.linear): layers only {layer_bytes / 1e6:.0f} MB {a * 1e3:.1f} ms "
              f"({layer_bytes / a / 1e9:.1f} GB/s) | with the LM head {nbytes / 1e6:.0f} MB "
              f"{b * 1e3:.1f} ms ({nbytes / b / 1e9:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
