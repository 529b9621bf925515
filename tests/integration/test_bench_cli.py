"""Each `bench` subcommand end to end on a tiny model: JSON with the documented keys, a PNG.

The benchmarks measure speed; these tests check what does not depend on it: the files, the
keys, token counts, and step counts (which the scheduler fixes exactly for a workload that is
all queued at once).
"""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.common import simulate_batching


def _read(out_dir, name):
    path = out_dir / f"{name}.json"
    assert path.is_file(), f"{name}.json was not written"
    return json.loads(path.read_text())


def test_ceilings_writes_positive_roofs(tmp_path):
    assert main(["ceilings", "--quick", "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "ceilings")
    for key in ("copy_gb_s", "gemv_gb_s", "matmul_gflop_s"):
        assert data[key] > 0, key
    assert data["machine"]["num_cpus"] >= 1


@pytest.mark.slow
def test_sweep_with_transformers_baseline(tmp_path, tiny_llama_dir):
    assert main(["sweep", "--model", str(tiny_llama_dir), "--quick", "--batch-sizes", "1,2",
                 "--output-len", "4", "--baseline", "transformers", "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "sweep")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert [p["batch_size"] for p in data["points"]] == [1, 2]
    for p in data["points"]:
        assert p["output_tokens"] == p["num_requests"] * 4
        for key in ("throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s",
                    "e2e_p99_s", "decode_step_s"):
            assert p[key] > 0, key
        assert p["roofline"]["step_s"] > 0
        assert p["hf_static"]["error"] is None
        assert p["hf_static"]["useful_tokens"] == p["num_requests"] * 4
        assert p["ratio_vs_hf_static"] == pytest.approx(
            p["throughput_tok_s"] / p["hf_static"]["throughput_tok_s"])
        gb = p["hf_generate_batch"]
        assert gb["error"] is not None or gb["useful_tokens"] == p["num_requests"] * 4
    assert data["points"][0]["profile_top_ops"], "batch-1 decode step was not profiled"
    assert data["knee"]["batch_size"] in (1, 2)
    assert data["floor"]["basis"] == "weight_bytes / GEMV bandwidth"
    names = [t["target"] for t in data["targets"]]
    assert any("floor" in n for n in names) and any("transformers" in n for n in names)


@pytest.mark.slow
def test_policies_counts_steps_like_the_arithmetic(tmp_path, tiny_llama_dir):
    assert main(["policies", "--model", str(tiny_llama_dir), "--quick", "--num-requests", "6",
                 "--max-num-seqs", "2", "--max-output", "24", "--arrival-rate", "0",
                 "--baseline", "transformers", "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "policies")
    assert (tmp_path / "policies.png").stat().st_size > 0
    lens = data["output_lens"]
    for policy in ("static", "dynamic", "continuous"):
        r = data[policy]
        for key in ("throughput_tok_s", "slot_utilization", "mean_latency_s"):
            assert r[key] > 0, (policy, key)
        assert r["num_tokens"] == sum(lens)
        # All requests queued at t=0: the engine's step count is exactly the idealized one.
        sim = simulate_batching(lens, 2, "static" if policy == "dynamic" else policy)
        assert r["num_steps"] == sim.num_steps, policy
        assert r["slot_utilization"] == pytest.approx(sim.utilization)
    assert data["continuous"]["slot_utilization"] >= data["static"]["slot_utilization"]
    # With a queue, continuous batching fills every slot: 2 slots, 2 tokens per step.
    assert data["continuous"]["slot_utilization_while_queued"] == pytest.approx(1.0)
    assert data["transformers_static"]["num_tokens"] == sum(lens)
    hol = data["head_of_line"]
    assert hol["output_lens"] == [1, 5, 100]  # 10/50/1000 scaled down by --quick
    assert hol["computed_static"]["utilization"] == pytest.approx(106 / 300)
    assert hol["measured_static"]["num_steps"] == 100
    assert hol["measured_static"]["slot_utilization"] == pytest.approx(106 / 300)


def test_every_benchmark_is_a_pdcluster_bench_subcommand():
    from router.cli import build_parser

    parser = build_parser()
    for name in ("ceilings", "sweep", "policies", "ttft_breakdown", "disagg", "serve",
                 "chaos", "prefix"):
        args = parser.parse_args(["bench", name, "--quick"])
        assert callable(args.func) and args.quick and args.out == "bench/results"
    args = parser.parse_args(["bench", "sweep", "--batch-sizes", "1,8", "--baseline", "transformers"])
    assert args.batch_sizes == "1,8" and args.baseline == "transformers"



def test_bad_batch_sizes_are_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--batch-sizes", "8,4", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "strictly increasing" in capsys.readouterr().err
