"""bench/studies/kernel_ab.py: two builds of the kernel source timed call by call, same answers."""

from __future__ import annotations

import re
import subprocess

import pytest

from bench.studies import kernel_ab


def test_ab_against_a_revision_prints_both_timings(capsys):
    assert kernel_ab.main(["--base", "HEAD", "--batches", "2", "--contexts", "40,70",
                           "--calls", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line, ctx in zip(lines, (40, 70), strict=True):
        m = re.fullmatch(rf"batch 2 context {ctx}: base ([\d.]+) ms \([\d.]+ GB/s\), new ([\d.]+) "
                         r"ms \([\d.]+ GB/s\), base / new ([\d.]+)x", line)
        assert m, line
        base, new, ratio = map(float, m.groups())
        assert base > 0 and new > 0 and ratio == pytest.approx(base / new, rel=0.05)


def test_an_unknown_revision_is_an_error():
    with pytest.raises(subprocess.CalledProcessError):
        kernel_ab.source_at("no-such-revision-anywhere")
