"""`pdcluster serve` configuration: defaults < YAML < flags, and clear errors."""

from __future__ import annotations

import json

import pytest

from router.cli.main import build_parser
from router.cli.serve_config import parse_bytes, serve_config_from_args


def _args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_documented_ones():
    cfg = serve_config_from_args(_args())
    assert (cfg.mode, cfg.prefill_workers, cfg.decode_workers) == ("disaggregated", 1, 1)
    assert (cfg.host, cfg.grpc_port, cfg.http_port) == ("127.0.0.1", 50051, 8000)
    assert cfg.ray_address is None and cfg.redis_url is None and cfg.model is None


def test_yaml_then_flags(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("decode-workers: 3\nmode: colocated\nkv_cache_memory: 256MiB\ngrpc-port: 6000\n")
    cfg = serve_config_from_args(_args("--config", str(f), "--grpc-port", "7000"))
    assert cfg.decode_workers == 3 and cfg.mode == "colocated"
    assert cfg.grpc_port == 7000  # the flag wins over the file
    cc = cfg.cluster_config()
    assert cc.num_prefill_workers == 0  # colocated: decode workers prefill
    assert cc.decode_engine.kv_cache_memory_bytes == 256 << 20


def test_threads_per_role_over_threads_per_worker():
    cc = serve_config_from_args(_args("--threads-per-worker", "3", "--decode-threads", "5"))
    assert cc.cluster_config().prefill_engine.num_threads == 3
    assert cc.cluster_config().decode_engine.num_threads == 5
    cc = serve_config_from_args(_args("--prefill-threads", "2")).cluster_config()
    assert cc.prefill_engine.num_threads == 2 and cc.decode_engine.num_threads >= 1
    with pytest.raises(ValueError, match="--decode-threads must be >= 1"):
        serve_config_from_args(_args("--decode-threads", "0"))


def test_unknown_yaml_key_is_named(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("decode_wrokers: 2\n")
    with pytest.raises(ValueError, match="decode_wrokers"):
        serve_config_from_args(_args("--config", str(f)))


@pytest.mark.parametrize("text,value", [("1GiB", 1 << 30), ("512MB", 512_000_000), ("4096", 4096),
                                        ("1.5KiB", 1536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="not a size"):
        serve_config_from_args(_args("--kv-cache-memory", "lots"))


def test_max_prefill_chunk_reaches_every_engine_and_a_bad_one_is_named():
    cc = serve_config_from_args(_args("--max-prefill-chunk", "64")).cluster_config()
    assert cc.prefill_engine.max_prefill_chunk == cc.decode_engine.max_prefill_chunk == 64
    assert serve_config_from_args(_args()).cluster_config().prefill_engine.max_prefill_chunk is None
    with pytest.raises(ValueError, match="--max-prefill-chunk must be > 0, got 0"):
        serve_config_from_args(_args("--max-prefill-chunk", "0"))


def test_decode_step_prefill_tokens_reaches_the_decode_engine_only():
    cc = serve_config_from_args(_args("--decode-step-prefill-tokens", "256")).cluster_config()
    assert cc.decode_engine.max_step_prefill_tokens == 256
    assert cc.prefill_engine.max_step_prefill_tokens is None
    # unset: the decode worker applies its own default (decode_workers.worker)
    assert serve_config_from_args(_args()).cluster_config().decode_engine.max_step_prefill_tokens \
        is None
    with pytest.raises(ValueError, match="--decode-step-prefill-tokens must be > 0, got 0"):
        serve_config_from_args(_args("--decode-step-prefill-tokens", "0"))


def test_tp_flags_reach_each_roles_engine_and_bad_ones_are_named():
    cc = serve_config_from_args(_args("--prefill-tp", "2", "--decode-tp", "4")).cluster_config()
    assert (cc.prefill_engine.tensor_parallel_size, cc.decode_engine.tensor_parallel_size) == (2, 4)
    assert serve_config_from_args(_args()).cluster_config().decode_engine.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="--decode-tp must be an integer >= 1"):
        serve_config_from_args(_args("--decode-tp", "0"))
    with pytest.raises(ValueError, match="--prefill-tp: colocated workers"):
        serve_config_from_args(_args("--mode", "colocated", "--prefill-tp", "2"))


def test_kv_offload_flags_reach_every_engine_and_bad_ones_are_named(tmp_path):
    cc = serve_config_from_args(_args("--kv-offload-memory", "64MiB", "--kv-offload-dir",
                                      str(tmp_path), "--kv-offload-disk", "1GiB")).cluster_config()
    for engine in (cc.prefill_engine, cc.decode_engine):
        assert engine.kv_offload_memory_bytes == 64 << 20
        assert (engine.kv_offload_dir, engine.kv_offload_disk_bytes) == (str(tmp_path), 1 << 30)
    off = serve_config_from_args(_args()).cluster_config().decode_engine
    assert off.kv_offload_memory_bytes == 0 and off.kv_offload_dir is None
    with pytest.raises(ValueError, match="--kv-offload-dir and --kv-offload-disk go together"):
        serve_config_from_args(_args("--kv-offload-memory", "64MiB", "--kv-offload-dir", "/x"))
    with pytest.raises(ValueError, match="--kv-offload-disk needs --kv-offload-memory"):
        serve_config_from_args(_args("--kv-offload-dir", "/x", "--kv-offload-disk", "1GiB"))
    with pytest.raises(ValueError, match="--kv-offload-memory: "):
        serve_config_from_args(_args("--kv-offload-memory", "lots"))


def test_autoscale_flags_reach_the_cluster_and_are_refused_without_it():
    """--autoscale with bounds and windows becomes the cluster's AutoscaleConfig (bounds
    default to the start counts; the thread split plans for the maximum); its settings
    without --autoscale, start counts outside the bounds, prefill bounds in colocated mode
    are refused, naming the flag."""
    def config(*argv):
        return serve_config_from_args(build_parser().parse_args(["serve", *argv]))

    auto = config("--autoscale", "--decode-workers", "2", "--max-decode-workers", "4",
                  "--autoscale-target", "0.6", "--autoscale-down-window-s", "120",
                  "--autoscale-migrate-after-s", "5").cluster_config().autoscale
    p = auto.policy
    assert (p.min_prefill, p.max_prefill, p.min_decode, p.max_decode) == (1, 1, 2, 4)
    assert (p.target_utilization, p.down_window_s, auto.drain_migrate_after_s) == (0.6, 120, 5)
    assert config().cluster_config().autoscale is None
    for argv, match in [
        (("--max-decode-workers", "3"), "--max-decode-workers needs --autoscale"),
        (("--autoscale-cooldown-s", "5"), "--autoscale-cooldown-s needs --autoscale"),
        (("--autoscale", "--decode-workers", "3", "--max-decode-workers", "2"),
         "min <= max|outside"),
        (("--autoscale", "--prefill-workers", "2", "--min-prefill-workers", "3",
          "--max-prefill-workers", "4"), "--prefill-workers 2 is outside"),
        (("--autoscale", "--mode", "colocated", "--max-prefill-workers", "2"),
         "colocated cluster has no prefill"),
        (("--autoscale", "--autoscale-target", "1.5"), "--autoscale-target"),
        (("--autoscale-profile", "p.json"), "--autoscale-profile needs --autoscale"),
    ]:
        with pytest.raises(ValueError, match=match):
            config(*argv)


def test_an_autoscale_profile_prices_a_prefill_worker_until_its_own_rate_is_measured(tmp_path):
    """--autoscale-profile: a `pdcluster profile` JSON gives the prefill rate (a 512-token
    prompt's) the autoscaler uses for a worker the router has not measured yet; once it has,
    the measurement wins. A file that is not a profile is refused, naming the flag."""
    from engine.tuning.profile import EngineProfile
    from router.cli.main import build_parser
    from router.cli.serve_config import serve_config_from_args
    from router.cluster.autoscale import Autoscaler
    from router.control.prefix_pull import PRIOR_PREFILL_TOKENS_S, PrefixPulls

    def config(*argv):
        return serve_config_from_args(build_parser().parse_args(["serve", *argv]))

    path = tmp_path / "profile.json"
    path.write_text(EngineProfile("m", 1, "cpu", 2048, 100,
                                  prefill=[(1, 256, 0.5), (1, 1024, 2.5)]).to_json())
    auto = config("--autoscale", "--autoscale-profile", str(path)).cluster_config().autoscale
    assert auto.prefill_tokens_s == pytest.approx(512 / 1.1667, rel=1e-3)  # 0.5 + 256 x 2/768
    assert config("--autoscale").cluster_config().autoscale.prefill_tokens_s is None

    # The autoscaler's rate for a prefill worker: the profile's, then the measured one.
    pulls = PrefixPulls(index=None, layout=None)  # only its rate bookkeeping is used here
    cluster = type("C", (), {"orchestrator": type("O", (), {"pulls": pulls})})
    scaler = Autoscaler(cluster, auto)
    assert scaler.prefill_rate("prefill-0") == pytest.approx(auto.prefill_tokens_s)
    pulls.note_prefill("prefill-0", 300, 1.0)
    assert scaler.prefill_rate("prefill-0") == pytest.approx(300.0)
    without = Autoscaler(cluster, config("--autoscale").cluster_config().autoscale)
    assert without.prefill_rate("prefill-1") == PRIOR_PREFILL_TOKENS_S

    bad = tmp_path / "bad.json"
    bad.write_text('{"model_id": "m"}')
    for f in (bad, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="--autoscale-profile .*not a `pdcluster profile`"):
            config("--autoscale", "--autoscale-profile", str(f))


def test_speculative_config_reaches_the_decode_workers_only_and_bad_ones_are_refused(tmp_path):
    """--speculative-config (JSON on the command line, a mapping in --config YAML) becomes the
    decode engines' config, checked and normalized; prefill workers never speculate. A bad
    one is refused at once, naming the flag and the problem."""
    def config(*argv):
        return serve_config_from_args(build_parser().parse_args(["serve", *argv]))

    cluster = config("--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3}').cluster_config()
    assert json.loads(cluster.decode_engine.speculative_config) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2, "adaptive": True}
    own = config("--speculative-config", '{"method": "self_draft", "num_speculative_tokens": 2}')
    assert json.loads(own.cluster_config().decode_engine.speculative_config)["quantization"] \
        == "int4"
    assert cluster.prefill_engine.speculative_config is None
    assert config().cluster_config().decode_engine.speculative_config is None
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("speculative_config: {method: ngram, num_speculative_tokens: 2, "
                         "prompt_lookup_min: 1}\n")
    spec = json.loads(config("--config", str(yaml_file)).cluster_config()
                      .decode_engine.speculative_config)
    assert (spec["num_speculative_tokens"], spec["prompt_lookup_min"]) == (2, 1)
    for value, match in [
        ('{"method": "ngram", "num_speculative_tokens": 0}',
         "--speculative-config: num_speculative_tokens must be an integer in 1..16, got 0"),
        ('{"method": "medusa", "num_speculative_tokens": 2}',
         "--speculative-config: method 'medusa' is not supported yet"),
        ("ngram", "--speculative-config: not valid JSON"),
    ]:
        with pytest.raises(ValueError) as e:
            config("--speculative-config", value)
        assert match in str(e.value)


def test_lora_flags_reach_both_roles_engines_and_bad_ones_are_named(tmp_path):
    """--enable-lora and its bounds reach prefill and decode engines alike (the prompt's KV
    and the tokens come from one adapter); --lora-modules (name=DIR, vLLM's JSON, or a YAML
    mapping) reaches the cluster, each worker holding them all by default; bad values are
    refused before any worker starts, naming the flag."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = serve_config_from_args(_args("--enable-lora", "--lora-modules", f"x={a}",
                                       json.dumps({"name": "y", "path": b}),
                                       "--max-lora-rank", "64"))
    cc = cfg.cluster_config()
    assert cc.lora_modules == (("x", a), ("y", b))
    for eng in (cc.prefill_engine, cc.decode_engine):
        assert (eng.enable_lora, eng.max_loras, eng.max_lora_rank, eng.max_cpu_loras) == (
            True, 1, 64, 2)
    off = serve_config_from_args(_args()).cluster_config()
    assert not off.decode_engine.enable_lora and off.lora_modules == ()
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"enable_lora: true\nlora_modules: {{x: {a}}}\nmax_cpu_loras: 4\n")
    cc = serve_config_from_args(_args("--config", str(yaml_file))).cluster_config()
    assert cc.lora_modules == (("x", a),) and cc.decode_engine.max_cpu_loras == 4
    for argv, match in [
        (["--lora-modules", f"x={a}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", f"x={a}", f"x={b}"], "'x' is given twice"),
        (["--enable-lora", "--lora-modules", "x"], "expected name=DIR"),
        (["--enable-lora", "--lora-modules", f"x={tmp_path}"], "no adapter_config.json"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras must be an integer >= 1"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
         r"--max-cpu-loras \(2\) must be >= --max-loras \(4\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            serve_config_from_args(_args(*argv))


def test_pooling_flags_reach_the_cluster_and_a_bad_one_is_refused():
    cc = serve_config_from_args(_args()).cluster_config()
    assert (cc.pooling, cc.normalize_embeddings) == ("last", True)
    cc = serve_config_from_args(_args("--pooling", "mean", "--no-normalize-embeddings")
                                ).cluster_config()
    assert (cc.pooling, cc.normalize_embeddings) == ("mean", False)
    with pytest.raises(SystemExit):  # argparse names the choices
        _args("--pooling", "max")
