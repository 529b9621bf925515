"""Each `bench` subcommand end to end on a tiny model: JSON with the documented keys, a PNG.

The benchmarks measure speed; these tests check what does not depend on it: the files, the
keys, token counts, and step counts (which the scheduler fixes exactly for a workload that is
all queued at once). `bench serve --target` runs against our HTTP server and against a fake
llama.cpp-like server (no max_model_len, an API key, ignore_eos dropped); `bench compare`
reads the results.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from bench.cli import main
from bench.harness.batching import simulate_batching
from tests.helpers.async_util import LoopThread


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
    # the engine's per-host kernel choice for the default model: one line per weight shape
    # (QKV, O, gate/up, down, LM head), each naming a path per batch bucket
    plan = data["linear_plan"]
    assert len(plan["summary"]) == 5 and all("M=1: " in line for line in plan["summary"])
    assert plan["timings"] and plan["host_key"]
    # the fused kernels were built here, and the decode attention choice is printed per bucket
    assert data["fused_cpu_kernels"].endswith(".so")
    assert len(data["decode_paths"]["summary"]) == 6 and data["decode_paths"]["timings"]
    # the prefill attention choice per KV length, SDPA against the fused kernel
    prefill = data["prefill_paths"]
    assert [t["n"] for t in prefill["timings"]] == [128, 512, 2048]
    assert all(set(t["seconds"]) == {"sdpa", "fused"} for t in prefill["timings"])
    assert prefill["summary"][0].startswith("L<=128: ")
    # and whether a pure-decode step runs fused, per bucket, with both timings behind it
    fused = data["fused_decode"]
    assert [t["m"] for t in fused["timings"]] == [1, 2, 4, 8, 16, 32]
    assert all(line.startswith(f"batch {t['m']}: ") for line, t in
               zip(fused["summary"], fused["timings"], strict=True))


def test_kernels_times_every_set_up_and_splits_the_step(tmp_path, tiny_llama_dir):
    assert main(["kernels", "--model", str(tiny_llama_dir), "--quick", "--batch-sizes", "1,2",
                 "--steps", "1", "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "kernels")
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        assert set(r["step_ms"]) == {"host plan", "layer by layer", "no wide tiles", "mm_t < 128 rows",
                                     "F.linear", "oneDNN", "no C kernels"}
        assert r["no_wide_over_host"] > 0
        assert all(v > 0 for v in r["step_ms"].values())
        split = r["step_split"]
        # Every layer of the stack was seen, and the parts add up to the step.
        assert split["gemm_ms"] > 0 and split["cpu_kernels_ms"] > 0 and split["scheduler_ms"] > 0
        assert split["outside_model_ms"] > split["scheduler_ms"]
        parts = (split["gemm_ms"] + split["cpu_kernels_ms"] + split["other_model_ms"]
                 + split["outside_model_ms"])
        assert parts == pytest.approx(split["step_ms"])
        assert 0 < r["outside_model_share"] < 1


def test_kernels_no_wide_set_up_takes_each_runner_up():
    """``no wide tiles``: a shape/bucket that chose ``cwide`` takes its runner-up, a fused
    bucket on wide tiles the dot tiles."""
    from bench.engine.kernels import _plans, _without_wide
    from engine.executor.fused_decode import FusedDecodePlan
    from engine.ops.linear import LinearPlan
    from engine.tuning.cache import Timing

    tuned = LinearPlan.from_timings([
        Timing(64, 32, 8, {"cwide": 1.0, "onednn": 2.0, "linear": 3.0}),
        Timing(64, 32, 1, {"cgemv": 1.0, "cwide": 1.5, "linear": 3.0})])
    no_wide = _plans(tuned)["no wide tiles"]
    assert no_wide.path(64, 32, 8) == "onednn" and no_wide.path(64, 32, 1) == "cgemv"
    fused = FusedDecodePlan({1: "fused", 2: "layers", 8: "wide", 32: "wide"})
    assert _without_wide(fused).choices == {1: "fused", 2: "layers", 8: "fused", 32: "fused"}
    assert _without_wide(FusedDecodePlan.everywhere("wide")).choices == dict.fromkeys(
        FusedDecodePlan.everywhere().choices, "fused")


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
    from router.cli.main import build_parser

    parser = build_parser()
    for name in ("ceilings", "sweep", "policies", "ttft_breakdown", "disagg", "serve",
                 "chaos", "prefix", "kv_cache"):
        args = parser.parse_args(["bench", name, "--quick"])
        assert callable(args.func) and args.quick and args.out == "bench/results"
    args = parser.parse_args(["bench", "sweep", "--batch-sizes", "1,8", "--baseline", "transformers"])
    assert args.batch_sizes == "1,8" and args.baseline == "transformers"



def test_bad_batch_sizes_are_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--batch-sizes", "8,4", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "strictly increasing" in capsys.readouterr().err


# ---- bench serve --target and bench compare ----------------------------------------------------
SERVE_LOAD = ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--no-progress",
              "--slo", "ttft=1000,tpot=1000"]


@pytest.fixture(scope="module")
def two_serve_results(tiny_frontdoor, tmp_path_factory):
    """Two `bench serve --target` runs at our server: labelled "ours" at rates 50,inf, and
    unlabelled (so labelled host:port) at rates 20,inf; returns (folder A, folder B)."""
    out = tmp_path_factory.mktemp("serve-target")
    url = f"http://127.0.0.1:{tiny_frontdoor.http_port}"
    assert main(["serve", "--target", f"{url}/v1/", "--label", "ours", "--request-rates",
                 "50,inf", *SERVE_LOAD, "--out", str(out / "a")]) == 0
    assert main(["serve", "--target", url, "--request-rates", "20,inf", *SERVE_LOAD,
                 "--out", str(out / "b")]) == 0
    return out / "a", out / "b"


def test_serve_target_loads_our_http_server_and_labels_the_result(tiny_frontdoor, two_serve_results):
    import httpx

    port = tiny_frontdoor.http_port
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
    a, b = (_read(d, "serve") for d in two_serve_results)
    assert a["server"]["label"] == "ours"
    assert b["server"]["label"] == f"127.0.0.1:{port}"
    for data in (a, b):
        assert data["config"]["api"] == "http"
        assert data["server"]["url"] == f"http://127.0.0.1:{port}"  # /v1/ stripped
        assert data["server"]["model_id"] == model["id"]
        assert data["server"]["max_model_len"] == model["max_model_len"]
        assert data["warnings"] == []  # ours reports usage and honours ignore_eos
        for r in data["rates"]:
            assert r["completed"] == 3, r["errors"]
            assert r["total_output_tokens"] == 3 * 4
            # The engine's own steps during the rate, read from our /metrics: 3 tokens per
            # request (4, the first from prefill) came from decode rows, in pure-decode steps
            # or in steps that also prefilled a newcomer (mixed), every one counted once.
            steps, mixed = r["engine_decode_steps"], r["engine_mixed_steps"]
            rows = [*steps["by_batch"].items(), *(mixed["by_batch"].items() if mixed else ())]
            assert sum(int(b) * v["steps"] for b, v in rows) == 3 * 3
            assert all(v["mean_s"] > 0 for _, v in rows)
            # (the tiny model has no tokenizer: its HTTP chunks are empty and not sent, so the
            # client sees every token at the end and a TPOT of ~0; the arithmetic still holds)
            assert r["engine_step_s"] > 0 and r["tpot_over_engine_step"] >= 0
            assert r["serving_overhead_per_token_s"] == pytest.approx(
                r["tpot_mean_s"] - r["engine_token_s"])
            assert r["engine_token_s"] == pytest.approx(
                r["engine_step_s"] + r["prefill_share_per_token_s"])
            assert (r["prefill_share_per_token_s"] == 0) == (mixed is None)
    assert [r["request_rate"] for r in a["rates"]] == [50.0, "inf"]


def test_serve_offline_threads_sets_the_served_tpot_beside_the_engine_alone(
        tiny_frontdoor, tiny_llama_dir, tmp_path):
    """One stream at a time, then the same prompts through the in-process engine: the served /
    offline ratio is the serving path's cost per token (issue [7/7])."""
    url = f"http://127.0.0.1:{tiny_frontdoor.http_port}"
    assert main(["serve", "--target", url, "--request-rates", "inf", "--max-concurrency", "1",
                 "--offline-threads", "1", "--model", str(tiny_llama_dir), *SERVE_LOAD,
                 "--out", str(tmp_path)]) == 0
    (row,) = _read(tmp_path, "serve")["rates"]
    off = row["offline"]
    assert off["num_threads"] == 1 and off["num_requests"] == 3
    assert 0 < off["tpot_p50_s"] <= off["itl_p99_s"] and off["ttft_p50_s"] > 0
    assert off["tpot_mean_s"] > 0
    # (the tiny model streams no text, so its served TPOT may be 0: no ratio, null in JSON)
    ratio = row["tpot_p50_over_offline"]
    assert (ratio is None if not row["tpot_p50_s"]
            else ratio == pytest.approx(row["tpot_p50_s"] / off["tpot_p50_s"]))


def test_serve_offline_threads_needs_one_stream_at_a_time(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", "http://127.0.0.1:9", "--offline-threads", "2",
              "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--max-concurrency 1" in capsys.readouterr().err


def test_compare_prints_one_table_per_common_rate(two_serve_results, tiny_frontdoor, tmp_path, capsys):
    a, b = two_serve_results
    capsys.readouterr()
    assert main(["compare", str(a / "serve.json"), str(b / "serve.json"),
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    other = f"127.0.0.1:{tiny_frontdoor.http_port}"
    assert "rate inf req/s" in printed
    assert "rate 50" not in printed and "rate 20" not in printed  # not in both files
    header = next(line for line in printed.splitlines() if line.startswith("rate inf"))
    assert "ours" in header and f"{other} / ours" in header
    for name in ("TTFT p50 (ms)", "TPOT p99 (ms)", "ITL p99 (ms)", "output throughput (tok/s)",
                 "request throughput (req/s)", "goodput (req/s)", "goodput (%)"):
        assert name in printed, name
    assert (tmp_path / "compare.png").stat().st_size > 0
    data = _read(tmp_path, "compare")
    assert [f["label"] for f in data["files"]] == ["ours", other]
    [table] = data["tables"]
    assert table["request_rate"] == "inf"
    rows = {(r["name"], r["unit"]): r for r in table["rows"]}
    tput = rows[("output throughput", "tok/s")]
    served = [_read(d, "serve")["rates"][-1]["output_throughput_tok_s"] for d in (a, b)]
    assert tput["values"] == pytest.approx(served)
    assert tput["ratios_to_first"] == pytest.approx([served[1] / served[0]])
    assert rows[("goodput", "%")]["values"] == [100.0, 100.0]


def test_compare_refuses_a_file_that_is_not_a_serve_result(tmp_path, capsys):
    from router.cli.main import main as pdcluster

    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"benchmark": "serve", "rates": [{"request_rate": 1.0}]}))
    (tmp_path / "sweep.json").write_text(json.dumps({"points": [], "knee": {}}))
    assert pdcluster(["bench", "compare", str(serve), str(tmp_path / "sweep.json"),
                      "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "sweep.json is not a `pdcluster bench serve` result" in err
    assert not (tmp_path / "compare.json").exists()


class FakeLlamaCpp:
    """A stand-in for llama.cpp's server on 127.0.0.1: /v1/models without max_model_len, a
    Bearer key required, and every completion ends after 3 tokens (ignore_eos dropped)."""

    KEY = "sk-test"

    def __init__(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.bodies: list[dict] = []
        app = Starlette(routes=[Route("/v1/models", self._models),
                                Route("/v1/completions", self._completions, methods=["POST"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        self._loop = LoopThread()
        self._serving = self._loop.run(self._start())

    async def _start(self):
        task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not task.done():
            await asyncio.sleep(0.005)
        return task

    def close(self) -> None:
        self._server.should_exit = True

        async def stopped():
            await self._serving
        self._loop.run(stopped(), 10)
        self._loop.close()
        self._sock.close()

    def _refused(self, request):
        from starlette.responses import JSONResponse

        if request.headers.get("authorization") != f"Bearer {self.KEY}":
            return JSONResponse({"error": {"message": "Invalid API Key"}}, status_code=401)
        return None

    async def _models(self, request):
        from starlette.responses import JSONResponse

        return self._refused(request) or JSONResponse({"object": "list", "data": [
            {"id": "tiny.gguf", "object": "model", "owned_by": "llamacpp",
             "meta": {"n_ctx_train": 2048, "n_vocab": 32000}}]})

    async def _completions(self, request):
        from starlette.responses import StreamingResponse

        if (refused := self._refused(request)) is not None:
            return refused
        body = await request.json()
        self.bodies.append(body)

        async def events():
            for _ in range(3):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": 3}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake_llamacpp():
    server = FakeLlamaCpp()
    yield server
    server.close()


def test_serve_target_records_what_another_server_does_not_honour(fake_llamacpp, tmp_path,
                                                                   monkeypatch, capsys):
    url = f"http://127.0.0.1:{fake_llamacpp.port}"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", url, *SERVE_LOAD, "--out", str(tmp_path)])
    assert e.value.code == 2 and "API key" in capsys.readouterr().err

    monkeypatch.setenv("OPENAI_API_KEY", FakeLlamaCpp.KEY)
    assert main(["serve", "--target", url, "--request-rates", "inf", "--label", "llama.cpp",
                 *SERVE_LOAD, "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "serve")
    assert data["server"]["label"] == "llama.cpp"
    assert data["server"]["model_id"] == "tiny.gguf" and data["server"]["max_model_len"] is None
    [rate] = data["rates"]
    assert rate["completed"] == 3, rate["errors"]  # the key reached every request
    assert rate["total_output_tokens"] == 3 * 3
    warnings = "\n".join(data["warnings"])
    assert rate["engine_decode_steps"] is None and rate["serving_overhead_per_token_s"] is None
    assert "no engine step counters" in warnings  # another server: no engine figures
    assert "no max_model_len" in warnings
    assert "ignore_eos" in warnings and "3 of 3 completed requests" in warnings
    sent = fake_llamacpp.bodies[-1]
    assert sent["model"] == "tiny.gguf" and sent["ignore_eos"] is True
    assert sent["max_tokens"] == 4 and len(sent["prompt"]) == 8
    assert all(isinstance(t, int) for t in sent["prompt"])


def test_kv_cache_capacity_counts_the_sequences_an_int8_pool_holds(tiny_llama_dir):
    """``bench kv_cache``'s capacity figure on the tiny model (512 B a token in fp32, 160 in
    int8): in 1 MiB, 128 blocks of 16 hold 14 prompts of 128 + 16 tokens at once, and the int8
    pool's 409 blocks every one of the 40 sent; nothing leaks."""
    import argparse

    from bench.cluster.kv_cache import _capacity, _mean_rounds
    from bench.harness.workload import make_prompts

    args = argparse.Namespace(model=str(tiny_llama_dir), budget_mib=1, num_threads=1)
    prompts = make_prompts(40, 128, 250, seed=0)
    fp, q = (_capacity(args, d, prompts) for d in ("auto", "int8"))
    assert (fp["blocks"], fp["bytes_per_token"], fp["sequences_by_blocks"]) == (128, 512, 14)
    assert (q["blocks"], q["bytes_per_token"]) == (409, 160)
    assert fp["max_concurrent_sequences"] == 14 and q["max_concurrent_sequences"] == 40
    assert fp["leaked_blocks"] == q["leaked_blocks"] == 0
    both = _mean_rounds([{"ttft_p50_s": 1.0, "x": 1}, {"ttft_p50_s": 3.0, "x": 1}])
    assert both["ttft_p50_s"] == 2.0 and len(both["rounds"]) == 2


def test_spec_reports_every_cell_against_no_speculation(tmp_path):
    """``bench spec`` on the default model (what it measures), one batch size, short answers,
    prompt lookup and the target as its own draft (``--draft-model``: self_draft's int4 copy
    of the default model would time its int4 kernels first, minutes on a fresh host): a cell
    per workload and method with both engines' figures, the drafts counted, the rewrite
    answers repeating their input, the target's own drafts all accepted where verified, the
    three targets."""
    from engine.weights.resolve import resolve_model

    own = str(resolve_model(None).model_dir)
    assert main(["spec", "--batch-sizes", "1", "--output-len", "12", "--methods", "ngram",
                 "--draft-model", own, "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "spec")
    cells = {(c["workload"], c["batch"], c["method"]): c for c in data["cells"]}
    assert set(cells) == {(w, 1, m) for w in ("rewrite", "chat")
                          for m in ("ngram", "draft_model")}
    for c in cells.values():
        assert c["streams"] == 1 and c["off"]["tpot_s"] > 0 and c["on"]["tpot_s"] > 0
        assert c["tpot_speedup"] > 0 and c["throughput_speedup"] > 0
        assert len(c["on"]["rounds"]) == len(c["off"]["rounds"]) == 2
        assert "proposed" in c["on"] and "proposed" not in c["off"]
    rewrite = cells[("rewrite", 1, "ngram")]["on"]
    assert rewrite["accepted"] > 0 and rewrite["mean_accepted_length"] > 1
    assert [t["goal"] for t in data["targets"]] == [2.0, 1.3, 1.0]
    assert all(t["measured"] is not None for t in data["targets"])
    for w in ("rewrite", "chat"):  # (the controller may verify none: a draft that costs
        on = cells[(w, 1, "draft_model")]["on"]  # what the target does never pays)
        assert on["accepted"] == on["proposed"]
        assert cells[(w, 1, "draft_model")]["identical_streams"] == 1


def test_lora_reports_every_cell_against_the_base(tmp_path):
    """``bench lora`` on the default model (what it measures), small: 4 requests at once, rank
    8 and 16, 1 and 4 adapters of all seven projections written in PEFT's format (no peft
    needed): a cell per rank and count with its ratios to the base, the base timed first and
    last, each rank's load time, and the 16-adapter target reported as not measured here."""
    assert main(["lora", "--batch", "4", "--ranks", "8,16", "--adapters", "1,4",
                 "--output-len", "4", "--out", str(tmp_path)]) == 0
    data = _read(tmp_path, "lora")
    assert [(c["rank"], c["adapters"]) for c in data["cells"]] == [(8, 1), (8, 4), (16, 1),
                                                                   (16, 4)]
    for c in data["cells"]:
        assert c["tpot_s"] > 0 and c["tpot_over_base"] > 0 and c["throughput_over_base"] > 0
    assert data["base"]["first"]["tpot_s"] > 0 and data["base"]["last"]["tpot_s"] > 0
    assert set(data["load_s"]) == {"8", "16"} and all(v > 0 for v in data["load_s"].values())
    (t,) = data["targets"]
    assert t["goal"] == 1.3 and t["comparison"] == "<=" and t["met"] is None
