"""One prepared GPU check of the engine's CUDA path: correctness first, then speed.

Run by ``bench/gpu_check.sh`` (which runs ``pytest tests/gpu`` first). Each check is one
function run under its own time limit in a child process (a CUDA hang or crash ends that
check, not the script); a failed check records its error in the JSON and the next one runs.
The JSON goes to ``--out`` (default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``./gpu_check.json``); a summary is printed at the end.

Checks: FlashInfer vs torch backend on one mixed batch; CUDA engine greedy tokens vs the CPU
fp32 engine on the default model (fp32 and bf16 match fractions); decode step time at batch
1/8/32 against the HBM floor (weight bytes / measured device-to-device copy bandwidth); CUDA
graphs on vs off; prefill tokens/s; with two or more GPUs, the NCCL transport tests and a
short disaggregated bench run. Importing this module needs neither CUDA nor flashinfer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BF16_ATOL = 2e-2  # FlashInfer vs torch backend, both bf16, outputs of O(1) magnitude
BF16_MIN_MATCH = 0.6  # greedy tokens of a bf16 engine vs the fp32 CPU engine (until divergence)
NUM_PROMPTS = 8
PROMPT_LEN = 48
NEW_TOKENS = 24
GRAPHS_MIN_MATCH = 0.9  # graphs on vs off, both bf16: padding changes GEMM shapes, not much else
# Explicit KV pools: a pool sized from 140 GB would give the block manager millions of blocks.
POOL_BYTES = 4 << 30
# The CPU engine the CUDA tokens are held to. Untuned: a first CPU start times its kernel paths
# at every core, and on a fresh 16-core GPU host that took over 70 s (over 240 s while FlashInfer
# compiled beside it), 2026-12-04; the reference needs the CPU's math, not its fastest paths.
CPU_REFERENCE = dict(device="cpu", dtype="float32", tune_kernels=False)


def match_fraction(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> float:
    """Fraction of ``want``'s tokens that ``got`` reproduces before each sequence's first
    divergence (after it, greedy continuations legitimately differ)."""
    total = sum(len(w) for w in want)
    same = 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=False):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0


@dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ---- helpers used inside the checks (run in the child process) ---------------------------
def _prompts(vocab: int, n: int = NUM_PROMPTS, length: int = PROMPT_LEN) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _greedy(max_tokens: int = NEW_TOKENS):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _tokens(llm, prompts, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, _greedy(max_tokens))]


def _free(*objs) -> None:
    import gc

    import torch

    del objs
    gc.collect()
    torch.cuda.empty_cache()


def _cuda_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the GPU (synchronised around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _decode_sched(runner, batch: int, context: int):
    """A decode-only SchedulerOutput of ``batch`` sequences, each ``context`` tokens long,
    in distinct pages (their KV is whatever the pool holds: timing only)."""
    from engine.config import cdiv
    from engine.core.scheduler import ScheduledChunk, SchedulerOutput

    pages = cdiv(context + 1, runner.block_size)
    if batch * pages > runner.num_blocks:
        raise ValueError(f"pool of {runner.num_blocks} blocks cannot hold {batch} x {pages}")
    chunks = [ScheduledChunk(request_id=f"b{i}", token_ids=[11], start_pos=context,
                             block_ids=list(range(i * pages, (i + 1) * pages)), sample=True,
                             sampling_params=_greedy(), num_output_tokens=0, output_token_ids=[])
              for i in range(batch)]
    return SchedulerOutput(chunks)


def _decode_step_ms(runner, batch: int, context: int) -> float:
    """Median wall time of one whole decode step (metadata, plan, model, sampling)."""
    sched = _decode_sched(runner, batch, context)
    return _cuda_ms(lambda: runner.execute(sched))


# ---- the checks ---------------------------------------------------------------------------
def check_flashinfer_vs_torch() -> dict[str, Any]:
    """Both backends on the same mixed bf16 batch (decodes over history, a prefill chunk
    over a cached prefix, a fresh prompt): max abs output difference."""
    import torch

    from engine.attention.backend import AttentionShape, SeqSlice, build_metadata
    from engine.attention.factory import create_backend

    dev = torch.device("cuda")
    bs, heads, kv_heads, d = 16, 9, 3, 64  # the default model's attention shape
    seqs = [SeqSlice([3, 7, 1], 40, 1), SeqSlice([5], 0, 1), SeqSlice([9, 2], 17, 1),
            SeqSlice([4, 8, 6, 10], 20, 37), SeqSlice([11, 12], 0, 20)]
    meta = build_metadata(seqs, bs)
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn(16, 2, bs, kv_heads, d, generator=gen, device=dev).bfloat16()
    t = meta.num_tokens
    q = torch.randn(t, heads, d, generator=gen, device=dev).bfloat16()
    k = torch.randn(t, kv_heads, d, generator=gen, device=dev).bfloat16()
    v = torch.randn(t, kv_heads, d, generator=gen, device=dev).bfloat16()
    shape = AttentionShape(heads, kv_heads, d, torch.bfloat16)
    outs, caches = {}, {}
    for name in ("torch", "flashinfer"):
        backend = create_backend(name, dev, shape)
        caches[name] = cache.clone()
        backend.plan(meta)
        outs[name] = backend.forward(0, q, k, v, caches[name]).float()
    diff = (outs["flashinfer"] - outs["torch"]).abs().max().item()
    return {"max_abs_diff": diff, "atol": BF16_ATOL, "pass": diff <= BF16_ATOL,
            "kv_writes_equal": bool(torch.equal(caches["torch"], caches["flashinfer"]))}


def check_tokens_vs_cpu() -> dict[str, Any]:
    """Default model: CPU fp32 engine vs CUDA fp32 (torch backend: exact) and CUDA bf16
    (the default backend and graphs)."""
    from engine import LLM

    cpu = LLM(**CPU_REFERENCE)
    prompts = _prompts(cpu.engine.model_config.vocab_size)
    want = _tokens(cpu, prompts)
    del cpu
    res: dict[str, Any] = {}
    for label, kw in (("fp32", dict(dtype="float32", attention_backend="torch")),
                      ("bf16", dict(dtype="bfloat16"))):
        llm = LLM(device="cuda", kv_cache_memory_bytes=POOL_BYTES, **kw)
        got = _tokens(llm, prompts)
        res[label] = {"match_fraction": match_fraction(got, want),
                      "exact": got == want,
                      "attention_backend": llm.engine.runner.attn_backend.name,
                      "cuda_graphs": llm.engine.runner.use_cuda_graphs}
        _free(llm)
    res["pass"] = res["fp32"]["exact"] and res["bf16"]["match_fraction"] >= BF16_MIN_MATCH
    return res


def check_tensor_parallel() -> dict[str, Any]:
    """Default model, fp32 (torch backend): TP 2 (two ranks, NCCL between them) gives TP 1's
    greedy tokens; decode throughput of both on the same prompts, for the record."""
    from engine import LLM

    res: dict[str, Any] = {}
    want = None
    for tp in (1, 2):
        llm = LLM(device="cuda", dtype="float32", attention_backend="torch",
                  kv_cache_memory_bytes=POOL_BYTES, tensor_parallel_size=tp)
        prompts = _prompts(llm.engine.model_config.vocab_size)
        t0 = time.perf_counter()
        got = _tokens(llm, prompts)
        res[f"tp{tp}_s"] = time.perf_counter() - t0
        want = got if want is None else want
        res[f"tp{tp}_match_fraction"] = match_fraction(got, want)
        llm.close()
        _free(llm)
    res["pass"] = res["tp2_match_fraction"] >= BF16_MIN_MATCH
    return res


def check_decode_vs_hbm_floor() -> dict[str, Any]:
    """Decode step time at batch 1/8/32 (context 512, graphs on) vs the floor of reading
    every weight once at the measured device-to-device copy bandwidth."""
    import torch

    from engine import LLM

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _cuda_ms(lambda: dst.copy_(src), iters=10)
    bw = 2 * n / (copy_ms / 1e3)  # read + write
    _free(src, dst)
    llm = LLM(device="cuda", kv_cache_memory_bytes=POOL_BYTES)
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    floor_ms = weight_bytes / bw * 1e3
    steps = {}
    for batch in (1, 8, 32):
        ms = _decode_step_ms(runner, batch, context=512)
        steps[str(batch)] = {"step_ms": ms, "x_floor": ms / floor_ms}
    return {"copy_GBps": bw / 1e9, "weight_bytes": weight_bytes, "hbm_floor_ms": floor_ms,
            "decode": steps, "cuda_graphs": runner.use_cuda_graphs,
            "attention_backend": runner.attn_backend.name}


def check_cuda_graphs_on_off() -> dict[str, Any]:
    """Decode step times and greedy tokens with CUDA graphs on vs off (default model, bf16)."""
    from engine import LLM

    res: dict[str, Any] = {}
    tokens = {}
    for label, flag in (("on", True), ("off", False)):
        llm = LLM(device="cuda", kv_cache_memory_bytes=POOL_BYTES, cuda_graphs=flag)
        runner = llm.engine.runner
        prompts = _prompts(llm.engine.model_config.vocab_size)
        tokens[label] = _tokens(llm, prompts)
        res[label] = {"graphs": runner.use_cuda_graphs,
                      "step_ms": {str(b): _decode_step_ms(runner, b, 256) for b in (1, 8, 32)}}
        _free(llm)
    res["token_match_fraction"] = match_fraction(tokens["on"], tokens["off"])
    res["speedup_batch1"] = res["off"]["step_ms"]["1"] / res["on"]["step_ms"]["1"]
    res["pass"] = res["on"]["graphs"] and res["token_match_fraction"] >= GRAPHS_MIN_MATCH
    return res


def check_prefill_throughput() -> dict[str, Any]:
    """Prompt tokens per second: 16 prompts of 1024 tokens, one output token each."""
    from engine import LLM

    llm = LLM(device="cuda", kv_cache_memory_bytes=POOL_BYTES, max_num_batched_tokens=8192)
    prompts = _prompts(llm.engine.model_config.vocab_size, n=16, length=1024)
    _tokens(llm, prompts[:2], max_tokens=1)  # warm-up
    # Other tokens than the warm-up's: nothing comes from the prefix cache.
    fresh = [[(t + 1) % llm.engine.model_config.vocab_size for t in p] for p in prompts]
    t0 = time.perf_counter()
    _tokens(llm, fresh, max_tokens=1)
    s = time.perf_counter() - t0
    return {"prompt_tokens": 16 * 1024, "seconds": s, "tokens_per_s": 16 * 1024 / s}


def _run_cmd(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    out = (p.stdout + p.stderr)[-3000:]
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{out}")
    return {"returncode": p.returncode, "tail": out[-1000:]}


def check_nccl_transport() -> dict[str, Any]:
    """Two GPUs: the KV transport's NCCL tests."""
    return _run_cmd([sys.executable, "-m", "pytest", "-q", "tests/gpu/test_kv_transport_nccl.py"],
                    timeout_s=110)


def check_disagg_run() -> dict[str, Any]:
    """Two GPUs: the smallest disaggregated bench run (``bench disagg --quick``)."""
    out = Path(os.environ.get("OUT") or ".") / "gpu_check_disagg"
    return _run_cmd([sys.executable, "-m", "bench.cli", "disagg", "--quick",
                     "--setups", "disaggregated", "--out", str(out)], timeout_s=140)


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[], dict[str, Any]]
    timeout_s: float
    min_gpus: int = 1
    needs_flashinfer: bool = False


CHECKS = (
    # Single-GPU limits total 250 s; with the shell's 90 s for pip and 140 s for pytest
    # tests/gpu, one H200 is done within 8 minutes even if every step runs to its limit.
    Check("flashinfer_vs_torch", check_flashinfer_vs_torch, 45, needs_flashinfer=True),
    Check("tokens_vs_cpu", check_tokens_vs_cpu, 70),
    Check("decode_vs_hbm_floor", check_decode_vs_hbm_floor, 45),
    Check("cuda_graphs_on_off", check_cuda_graphs_on_off, 55),
    Check("prefill_throughput", check_prefill_throughput, 35),
    Check("nccl_transport", check_nccl_transport, 120, min_gpus=2),
    Check("tensor_parallel", check_tensor_parallel, 90, min_gpus=2),
    Check("disagg_run", check_disagg_run, 150, min_gpus=2),
)


# ---- the driver ---------------------------------------------------------------------------
def _child(fn: Callable[[], dict[str, Any]], conn) -> None:
    try:
        conn.send(("ok", fn()))
    except BaseException as e:  # noqa: BLE001 -- report anything, the parent decides
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def run_check(check: Check, gpus: int, have_flashinfer: bool) -> CheckResult:
    """Run one check in a spawned process under its time limit; never raises."""
    if gpus < check.min_gpus:
        return CheckResult(check.name, True, 0.0, {"skipped": f"needs {check.min_gpus} GPUs, "
                                                   f"have {gpus}"})
    if check.needs_flashinfer and not have_flashinfer:
        return CheckResult(check.name, False, 0.0, error="flashinfer is not installed")
    ctx = mp.get_context("spawn")  # a fresh CUDA context per check
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(check.fn, send), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    send.close()
    status, payload = "error", f"timed out after {check.timeout_s:.0f}s"
    try:
        if recv.poll(check.timeout_s):
            status, payload = recv.recv()
    except EOFError:  # the child died without a word (a CUDA crash, the OOM killer)
        proc.join(10)
        payload = f"the check's process died with exit code {proc.exitcode}"
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    seconds = time.perf_counter() - t0
    if status == "ok":
        return CheckResult(check.name, bool(payload.get("pass", True)), seconds, payload)
    return CheckResult(check.name, False, seconds, error=str(payload))


def environment() -> dict[str, Any]:
    import torch

    from engine.executor.device import flashinfer_available

    env: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(),
                           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                           "flashinfer": flashinfer_available()}
    if env["gpus"]:
        env["gpu_name"] = torch.cuda.get_device_name(0)
    if env["flashinfer"]:
        import importlib.metadata

        env["flashinfer_version"] = importlib.metadata.version("flashinfer-python")
    return env


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def _summary_line(r: CheckResult) -> str:
    state = "skip" if "skipped" in r.result else ("PASS" if r.ok else "FAIL")
    detail = r.error.splitlines()[0][:160] if r.error else json.dumps(r.result)[:300]
    return f"{state:4}  {r.name:22} {r.seconds:6.1f}s  {detail}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: see module doc)")
    ap.add_argument("--only", default="", help="comma-separated check names to run")
    ap.add_argument("--pytest-json", type=Path, default=None,
                    help="a JSON file with the tests/gpu pytest result, merged into the output")
    args = ap.parse_args(argv)
    out = args.out or default_out()
    env = environment()
    report: dict[str, Any] = {"environment": env, "checks": {}}
    if args.pytest_json and args.pytest_json.exists():
        report["pytest_gpu"] = json.loads(args.pytest_json.read_text())
    only = {s for s in args.only.split(",") if s}
    results = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        if not env["cuda_available"]:
            r = CheckResult(check.name, False, 0.0, error="CUDA is not available")
        else:
            print(f"--- {check.name} (limit {check.timeout_s:.0f}s)", flush=True)
            r = run_check(check, env["gpus"], env["flashinfer"])
        results.append(r)
        report["checks"][r.name] = asdict(r)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))  # after every check: a kill keeps the rest
    print("\n=== gpu_check summary", json.dumps(env))
    if "pytest_gpu" in report:
        print(f"pytest tests/gpu: {report['pytest_gpu']}")
    for r in results:
        print(_summary_line(r))
    print(f"JSON: {out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
