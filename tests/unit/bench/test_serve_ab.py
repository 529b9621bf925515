"""bench.harness.serve_ab's bookkeeping: variants alternate their order round by round, and a
cell is each metric's median over the rounds (the servers themselves: the studies' runs)."""

from __future__ import annotations

from bench.harness import serve_ab


def test_variants_alternate_and_cells_are_medians(monkeypatch):
    order: list[tuple[str, ...]] = []
    values = iter([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])

    def fake_serve(flags, load, out):
        order.append(tuple(flags))
        v = next(values)
        return {"1.0": dict.fromkeys(serve_ab.METRICS, v)}

    monkeypatch.setattr(serve_ab, "serve_once", fake_serve)
    res = serve_ab.run_ab({"a": ["--x"], "b": ["--y"]}, serve_ab.Load(), rounds=3,
                          progress=lambda _: None)
    assert order == [("--x",), ("--y",), ("--y",), ("--x",), ("--x",), ("--y",)]
    # a ran 10, 40, 50; b ran 20, 30, 60
    assert res["cells"]["1.0"]["a"]["ttft_p50_s"] == 40.0
    assert res["cells"]["1.0"]["b"]["itl_p99_s"] == 30.0
    assert [r["variant"] for r in res["runs"]] == ["a", "b", "b", "a", "a", "b"]
