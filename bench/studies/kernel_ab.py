"""A/B the paged decode attention kernel of two source revisions, interleaved in one process.

    python -m bench.studies.kernel_ab --base REV [--batches 1,32] [--contexts 300,600,1200,2000]
                              [--calls 15]

Builds ``engine/ops/csrc/cpu_ops.c`` as it is at git revision ``REV`` and as it is in the working
tree (the machine's compiler, the engine's flags: ``engine.ops.cpu_ops.CFLAGS``), loads both
libraries, and times ``paged_decode`` over the default model's attention shapes (9 query
heads over 3 KV heads of 64, 16-token pages scattered through the pool as a serving engine's
are) with the two builds alternating call by call, so a noisy neighbour hits both alike. Prints
per batch and context the median ms per layer of each, the K/V bandwidth, and base / new.

A kernel change measured in separate processes on these shared machines moves by more than
the change itself; this is how ``docs/benchmarks.md`` measures one.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.ops import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
WARM_CALLS = 3


@dataclass(frozen=True)
class AbRow:
    batch: int
    context: int
    base_ms: float
    new_ms: float

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * 2 * KV_HEADS * HEAD_DIM * 4

    def line(self) -> str:
        gb = self.kv_bytes / 1e9
        return (f"batch {self.batch} context {self.context}: base {self.base_ms:.4f} ms "
                f"({gb / self.base_ms * 1e3:.1f} GB/s), new {self.new_ms:.4f} ms "
                f"({gb / self.new_ms * 1e3:.1f} GB/s), base / new {self.base_ms / self.new_ms:.2f}x")


def build(source: str, out_dir: Path, name: str) -> ctypes.CDLL:
    """Compile ``source`` (C text) with the engine's flags; raises CalledProcessError on failure."""
    src, obj, lib = out_dir / f"{name}.c", out_dir / f"{name}.o", out_dir / f"{name}.so"
    src.write_text(source)
    cc = os.environ.get("CC") or "cc"
    subprocess.run([cc, *cpu_ops.CFLAGS, "-c", "-o", str(obj), str(src)], check=True,
                   capture_output=True)
    subprocess.run([cc, *cpu_ops.LDFLAGS, "-o", str(lib), str(obj), "-lm"], check=True,
                   capture_output=True)
    return load(lib)


def load(lib: Path) -> ctypes.CDLL:
    """A built library with ``paged_decode``'s signature set."""
    dll = ctypes.CDLL(str(lib))
    dll.paged_decode.argtypes, dll.paged_decode.restype = cpu_ops._SIGNATURES["paged_decode"], None
    return dll


def source_at(rev: str) -> str:
    """``engine/ops/csrc/cpu_ops.c`` at git revision ``rev`` (raises CalledProcessError if absent)."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", "show", f"{rev}:engine/ops/csrc/cpu_ops.c"], cwd=root, check=True,
                          capture_output=True, text=True).stdout


def measure(base: ctypes.CDLL, new: ctypes.CDLL, batch: int, context: int, calls: int,
            seed: int = 0) -> AbRow:
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // BLOCK)
    cache = torch.randn(batch * pages + 1, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    tables = (torch.randperm(batch * pages, generator=g) + 1).view(batch, pages).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    outs = {"base": torch.empty_like(q), "new": torch.empty_like(q)}
    times: dict[str, list[float]] = {"base": [], "new": []}
    for i in range(WARM_CALLS + calls):
        for name, lib in (("base", base), ("new", new)) if i % 2 == 0 else (("new", new), ("base", base)):
            t0 = time.perf_counter()
            lib.paged_decode(q.data_ptr(), q.stride(0), cache.data_ptr(), tables.data_ptr(), pages,
                             lens.data_ptr(), outs[name].data_ptr(), batch, HEADS, KV_HEADS,
                             HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, torch.get_num_threads(), 0)
            if i >= WARM_CALLS:
                times[name].append(time.perf_counter() - t0)
    torch.testing.assert_close(outs["new"], outs["base"], atol=1e-5, rtol=1e-5)  # same answer
    return AbRow(batch, context, statistics.median(times["base"]) * 1e3,
                 statistics.median(times["new"]) * 1e3)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.kernel_ab", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="git revision of the kernel source to compare with")
    p.add_argument("--batches", type=_ints, default=[1, 32])
    p.add_argument("--contexts", type=_ints, default=[300, 600, 1200, 2000])
    p.add_argument("--calls", type=int, default=15, help="timed calls of each build per cell")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base_source, new_source = source_at(args.base), cpu_ops.SOURCE.read_text()
        new = build(new_source, Path(tmp), "new")
        # The same source builds the same library (~10 s a build): built once, loaded from a
        # second file, since dlopen of one path would hand back the same library.
        base = (build(base_source, Path(tmp), "base") if base_source != new_source
                else load(shutil.copy(Path(tmp) / "new.so", Path(tmp) / "base.so")))
        for b in args.batches:
            for c in args.contexts:
                print(measure(base, new, b, c, args.calls).line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
