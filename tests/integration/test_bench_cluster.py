"""The cluster benchmarks (`ttft_breakdown`, `disagg`, `serve`) end to end on the tiny model.

They measure speed; these tests check what does not depend on it: the JSON keys the docs and
the lead's tooling read, byte and token counts fixed by the workload, goodput's arithmetic at
SLOs every request meets or none can, the PNG, and that Ray is shut down afterwards (other
test modules may share one: tests/helpers/shared_ray.py).
"""

from __future__ import annotations

import json

import pytest

from bench.cluster import disagg, ttft_breakdown
from bench.server import serve_load
from engine.weights.resolve import load_model_config
from router.cli.main import build_parser


def _run(module, argv: list[str]) -> dict:
    """Through the real `pdcluster bench` parser, as a user runs it."""
    args = build_parser().parse_args(["bench", *argv])
    assert args.func is module.run
    return args.func(args)


def _read(out_dir, name: str) -> dict:
    path = out_dir / f"{name}.json"
    assert path.is_file(), f"{name}.json was not written"
    assert (out_dir / f"{name}.png").stat().st_size > 0, f"{name}.png is missing or empty"
    return json.loads(path.read_text())


def _assert_ray_down():
    import ray

    assert not ray.is_initialized(), "the benchmark left Ray running"


@pytest.mark.slow
def test_ttft_breakdown_splits_ttft_and_counts_kv_bytes(tmp_path, tiny_llama_dir):
    prompt_len = 48
    _run(ttft_breakdown, ["ttft_breakdown", "--model", str(tiny_llama_dir), "--quick",
                          "--prompt-len", str(prompt_len), "--num-requests", "2",
                          "--concurrency", "2", "--decode-tp", "2", "--out", str(tmp_path)])
    _assert_ray_down()
    data = _read(tmp_path, "ttft_breakdown")
    cfg = load_model_config(tiny_llama_dir)
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * prompt_len  # fp32
    cells = {(p["mode"], p["phase"], p["prefill_tp"], p["decode_tp"]) for p in data["phases"]}
    # The TP 1 pair, then the asked-for pair (its KV over per-rank pairs), same prompts.
    assert cells == {(m, ph, 1, tp) for m in ("stream_layers", "send_at_end")
                     for ph in ("sequential", "concurrent") for tp in (1, 2)}
    assert data["tp"]["decode_tp"] == 2 and data["tp"]["send_at_end/sequential"]["tail_ratio"] > 0
    for p in data["phases"]:
        assert p["kv_bytes_per_request"] == kv_bytes, p["mode"]
        assert len(p["requests"]) == 2
        for r in p["requests"]:
            parts = r["queue_s"] + r["prefill_compute_s"] + r["transfer_tail_s"]
            assert r["prefill_compute_s"] > 0 and r["transfer_tail_s"] >= 0
            assert r["ttft_s"] >= parts - 1e-3, "the parts exceed the TTFT the client saw"
            assert r["ttft_s"] == pytest.approx(parts + r["other_s"], abs=1e-3)
    assert data["kv_bytes_per_request"] == kv_bytes
    assert data["tail_over_compute_streaming"] >= 0
    assert data["targets"][0]["goal"] == ttft_breakdown.TAIL_TARGET


@pytest.mark.slow
def test_disagg_measures_every_setup(tmp_path, tiny_llama_dir):
    streams, out_len = 2, 8
    _run(disagg, ["disagg", "--model", str(tiny_llama_dir), "--quick", "--num-streams",
                  str(streams), "--stream-prompt-len", "8", "--output-len", str(out_len),
                  "--num-long", "2", "--long-prompt-len", "64", "--long-interval-s", "0.05",
                  "--chunk-size", "16", "--prefill-tp", "2", "--out", str(tmp_path)])
    _assert_ray_down()
    data = _read(tmp_path, "disagg")
    assert set(data["setups"]) == set(disagg.SETUPS)  # a TP flag adds disaggregated_tp
    assert data["config"]["prefill_tp"] == 2
    assert data["ratios"]["ttft_mean_disaggregated_tp_over_disaggregated"] > 0
    for name, s in data["setups"].items():
        for key in ("itl_p50_s", "itl_p99_s", "ttft_mean_s", "ttft_p99_s"):
            assert s[key] > 0, (name, key)
        assert s["itl_p99_s"] >= s["itl_p50_s"]
        assert s["stream_tokens"] == streams * out_len, name
        # One chunk per decode step and request: every token after the first has one ITL.
        assert s["num_itl_all"] == streams * (out_len - 1), name
        assert 0 < s["num_itl_samples"] <= s["num_itl_all"], name
        assert len(s["long_arrivals_s"]) == 2
    r = data["ratios"]["itl_p99_colocated_unchunked_over_disaggregated"]
    assert r == pytest.approx(data["setups"]["colocated_unchunked"]["itl_p99_s"]
                              / data["setups"]["disaggregated"]["itl_p99_s"])
    assert data["targets"][0]["measured"] == r


@pytest.mark.slow
def test_prefix_runs_each_policy_on_the_same_requests(tmp_path, tiny_llama_dir):
    from bench.cluster import prefix

    convs, turns, out_len = 3, 3, 4
    _run(prefix, ["prefix", "--model", str(tiny_llama_dir), "--quick", "--workloads",
                  "multi_turn", "--policies", "kv_aware,round_robin", "--conversations",
                  str(convs), "--turns", str(turns), "--doc-len", "40", "--user-len", "8",
                  "--output-len", str(out_len), "--think-s", "1", "--cache-fraction", "2",
                  "--out", str(tmp_path)])
    _assert_ray_down()
    data = _read(tmp_path, "prefix")
    runs = data["results"]["multi_turn"]
    assert set(runs) == {"kv_aware", "round_robin"}
    # The same seeded conversations under both policies: equal prompt lengths.
    prompt_tokens = sum(40 + t * (out_len + 8) for t in range(turns)) * convs
    for name, r in runs.items():
        assert r["requests"] == convs * turns and r["prompt_tokens"] == prompt_tokens, name
        assert 0 < r["computed_prompt_tokens"] <= prompt_tokens, name
        assert r["kv_bytes_moved"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0, name
    # kv_aware sends later turns to the decode worker that holds the conversation (how
    # often depends on timing: the index learns of a turn within a refresh, 0.25 s).
    assert runs["kv_aware"]["decode_hit_rate"] > 0
    r = data["ratios"]["multi_turn_kv_bytes_round_robin_over_kv_aware"]
    assert r == pytest.approx(runs["round_robin"]["kv_bytes_moved"]
                              / runs["kv_aware"]["kv_bytes_moved"])


def test_prefix_rejects_an_unknown_policy(tmp_path):
    from bench.cluster import prefix

    with pytest.raises(ValueError, match="unknown"):
        _run(prefix, ["prefix", "--policies", "kv_aware,random", "--out", str(tmp_path)])


def test_disagg_rejects_an_unknown_setup(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        _run(disagg, ["disagg", "--setups", "colocated,bogus", "--out", str(tmp_path)])


def test_disagg_parses_targets():
    assert disagg.parse_targets(["vllm=http://127.0.0.1:8001/v1", "127.0.0.1:8161"]) == [
        ("vllm", "http://127.0.0.1:8001"), ("127.0.0.1:8161", "http://127.0.0.1:8161")]
    for bad in (["a=ftp://h:1"], ["a=h:1", "a=h:2"], []):
        with pytest.raises(ValueError):
            disagg.parse_targets(bad)


def test_disagg_loads_running_servers_over_http(tmp_path, default_model_frontdoor):
    """`bench disagg --target`: the same streams and long prompts, over streamed
    /v1/completions, against a running server; one entry per label."""
    url = f"http://127.0.0.1:{default_model_frontdoor.http_port}"
    streams, out_len = 2, 6
    _run(disagg, ["disagg", "--num-streams", str(streams), "--stream-prompt-len", "8",
                  "--output-len", str(out_len), "--num-long", "2", "--long-prompt-len", "48",
                  "--long-interval-s", "0.05", "--target", f"ours={url}", "--target",
                  f"again={url}/v1", "--seed", "3", "--out", str(tmp_path)])
    data = _read(tmp_path, "disagg_servers")
    assert list(data["setups"]) == ["ours", "again"]
    assert data["config"]["servers"] == {"ours": url, "again": url}
    for name, s in data["setups"].items():
        # One SSE event per token that has text: at most out_len per stream, one ITL fewer.
        assert 0 < s["stream_tokens"] <= streams * out_len, name
        assert s["num_itl_all"] == s["stream_tokens"] - streams, name
        assert s["itl_p99_s"] >= s["itl_p50_s"] > 0, name
        assert s["ttft_p99_s"] >= s["ttft_p50_s"] > 0, name
        assert len(s["long_arrivals_s"]) == 2
    assert min(data["ratios"].values()) == 1.0


def test_disagg_refuses_a_server_too_short_for_its_prompts(tmp_path, default_model_frontdoor):
    url = f"http://127.0.0.1:{default_model_frontdoor.http_port}"
    with pytest.raises(ValueError, match="max_model_len"):
        _run(disagg, ["disagg", "--long-prompt-len", "100000", "--target", url,
                      "--out", str(tmp_path)])


def test_serve_parses_rates_and_slos():
    assert serve_load.parse_rates("1, 2,inf") == [1.0, 2.0, float("inf")]
    assert serve_load.parse_slo("ttft=0.5,tpot=0.1") == {"ttft": 0.5, "tpot": 0.1}
    for bad in ("0", "x", ""):
        with pytest.raises(ValueError, match="request-rates"):
            serve_load.parse_rates(bad)
    for bad in ("ttft", "itl=1", "ttft=-1", "ttft=abc"):
        with pytest.raises(ValueError, match="slo"):
            serve_load.parse_slo(bad)


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_serve_sweeps_rates_against_a_running_server(tmp_path, tiny_frontdoor, api):
    port = tiny_frontdoor.grpc_port if api == "grpc" else tiny_frontdoor.http_port
    num, out_len = 4, 6
    common = ["serve", "--address", f"127.0.0.1:{port}", "--api", api, "--num-prompts",
              str(num), "--input-len", "12", "--output-len", str(out_len), "--no-progress"]
    _run(serve_load, [*common, "--request-rates", "50,inf", "--slo", "ttft=1000,tpot=1000",
                      "--out", str(tmp_path / "easy")])
    easy = _read(tmp_path / "easy", "serve")
    assert [r["request_rate"] for r in easy["rates"]] == [50.0, "inf"]
    for r in easy["rates"]:
        assert r["completed"] == num and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] == num * out_len
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for stat in ("mean", "p50", "p90", "p99"):
                assert f"{metric}_{stat}_s" in r, (metric, stat)
        assert r["e2e_p99_s"] >= r["ttft_p50_s"] > 0
        assert r["output_throughput_tok_s"] == pytest.approx(
            r["total_output_tokens"] / r["duration_s"])
        # Every request meets SLOs of 1000 s: goodput is the whole throughput.
        assert r["goodput_fraction"] == 1.0
        assert r["goodput_req_s"] == pytest.approx(r["request_throughput_req_s"])
        if api == "grpc":  # token ids stream per step; HTTP skips the tiny model's empty text
            assert r["tpot_p50_s"] > 0 and r["itl_p50_s"] > 0
    _run(serve_load, [*common, "--request-rates", "inf", "--slo", "ttft=0.000001",
                      "--out", str(tmp_path / "hard")])
    hard = _read(tmp_path / "hard", "serve")["rates"][0]
    assert hard["completed"] == num
    assert hard["goodput_fraction"] == 0.0 and hard["goodput_req_s"] == 0.0


def test_serve_refuses_lengths_beyond_the_servers_context(tmp_path, tiny_frontdoor):
    with pytest.raises(ValueError, match="max_model_len"):
        _run(serve_load, ["serve", "--address", f"127.0.0.1:{tiny_frontdoor.grpc_port}",
                          "--input-len", "500", "--output-len", "100", "--no-progress",
                          "--out", str(tmp_path)])


@pytest.mark.slow
def test_chaos_loses_nothing_when_workers_die(tmp_path, tiny_llama_dir):
    """The SIGKILL round (a decode worker, then a prefill worker, then an abort storm): every
    stream completes with the undisturbed run's tokens, nothing leaks, and the killed
    workers are restarted and ready again. (The SIGSTOP round's detection is the same code
    test_disaggregation.py tests with SIGSTOP; CI runs one round to save 30 s.)"""
    from bench.cluster import chaos

    _run(chaos, ["chaos", "--model", str(tiny_llama_dir), "--quick", "--streams", "4",
                 "--max-tokens", "300", "--aborts", "20", "--prompt-len", "24",
                 "--signals", "SIGKILL", "--out", str(tmp_path)])
    _assert_ray_down()
    data = _read(tmp_path, "chaos")
    assert [r["signal"] for r in data["rounds"]] == ["SIGKILL"]
    r = data["rounds"][0]
    assert r["requests"] == 8 and r["completed"] == 8 and r["identical"] == 8, r
    assert r["migrated_streams"] > 0 and sum(r["migrations"].values()) >= r["migrated_streams"]
    assert r["blocks_leaked"] == {}
    assert r["workers_ready"] == r["workers"] == 4, r  # the killed ones came back
    # both SIGKILL'd workers (the decode victim and prefill-0) were restarted by Ray
    assert r["restarts"].get("prefill-0") == 1 and len(r["restarts"]) == 2, r
    assert all(t["met"] for t in data["targets"])
