"""`pdcluster serve`: flags (or a YAML file of the same keys) -> ServeConfig
(router/cli/serve_config.py) -> running cluster and front doors, drained on SIGTERM.

Importing this module stays cheap (no torch): every `pdcluster` command builds its parser."""

from __future__ import annotations

import argparse
import asyncio
import json

# engine.config is torch-free (a `pdcluster` command that loads no model imports no torch).
from engine.config import ATTENTION_BACKEND_CHOICES, DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from engine.config import QUANTIZATION_CHOICES as QUANT_CHOICES
from engine.contract import POOLING_CHOICES
from router.cli.lora_flags import add_lora_flags
from router.cli.serve_config import DEVICE_CHOICES
from router.frontdoor.openai.reasoning import REASONING_PARSERS


def add_serve_subcommand(sub) -> None:
    p = sub.add_parser("serve", help="start the router, workers and the gRPC + HTTP front door")
    # One helper per group of flags, called in --help's order.
    _add_cluster_flags(p)
    _add_device_flags(p)
    _add_engine_flags(p)
    add_lora_flags(p)
    _add_embedding_flags(p)
    _add_lifecycle_flags(p)
    _add_routing_flags(p)
    _add_security_flags(p)
    _add_observability_flags(p)
    # Failure tests only (fault injection), so not in --help: JSON {worker id: {fault_*: v}}.
    p.add_argument("--worker-overrides", type=json.loads, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file; keys are these flags' long names")
    p.add_argument("--model", default=None, help="local HF dir or GGUF (default: SmolLM2-135M)")
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default=None)
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--ray-address", default=None, help="join a running Ray cluster ('auto')")
    p.add_argument("--redis-url", default=None,
                   help="redis://[:PASSWORD@]host:port/db or rediss:// (TLS); default: the "
                        "in-process store. Serving goes on while Redis is down")
    p.add_argument("--require-redis", action="store_true", default=None,
                   help="refuse to start while --redis-url does not answer (default: start "
                        "without it and catch up when it does)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache per worker, e.g. 1GiB (default: 1GiB on CPU; on GPU what the "
                        "weights leave of --gpu-memory-utilization)")
    p.add_argument("--kv-offload-memory", default=None,
                   help="a second KV cache tier per worker: prefix blocks its pool evicts are "
                        "kept in this much host memory (pinned on GPU) and restored on a hit "
                        "instead of recomputed, e.g. 4GiB (default: off)")
    p.add_argument("--kv-offload-dir", default=None,
                   help="and behind it a disk tier: each worker's own directory under DIR "
                        "(removed on exit); needs --kv-offload-disk")
    p.add_argument("--kv-offload-disk", default=None,
                   help="the disk tier's cap per worker, e.g. 20GiB (needs --kv-offload-dir)")


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    dev = p.add_argument_group("devices (docs/deployment.md, GPUs)")
    dev.add_argument("--device", choices=list(DEVICE_CHOICES), default=None,
                     help="auto (default): GPUs when the Ray cluster has them; cuda: require "
                          "them (fail at start-up without); cpu: never")
    dev.add_argument("--dtype", choices=list(DTYPE_CHOICES), default=None,
                     help="weights and KV cache (default auto: bfloat16 on GPU, float32 on CPU)")
    dev.add_argument("--quantization", choices=list(QUANT_CHOICES), default=None,
                     help="linear layers on CPU workers: auto (default) serves a GGUF, the "
                          "default model included, in its own blocks and other models in fp; "
                          "none: fp (a GGUF dequantized); int8 / int4 (groups of 32) quantize "
                          "fp weights at load; gguf: a GGUF's own Q8_0/Q4_0/Q4_1/Q4_K blocks "
                          "(docs/models.md)")
    dev.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPE_CHOICES), default=None,
                     help="how the KV cache stores K and V: auto (default) the model's dtype; "
                          "int8: int8 values with a scale per token and KV head, ~3.8x the "
                          "tokens per byte of fp32, moved between workers as stored "
                          "(docs/kv-cache.md); fp8: not served yet")
    dev.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="speculative decoding on the decode (and colocated) workers, "
                          "vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                          "4}' (prompt lookup; prompt_lookup_max / _min, adaptive); default off "
                          "(docs/speculative-decoding.md)")
    dev.add_argument("--attention-backend", choices=list(ATTENTION_BACKEND_CHOICES), default=None,
                     help="auto (default): flashinfer on GPU when installed, else torch")
    dev.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="replay decode steps from CUDA graphs (default: on for GPU workers)")
    dev.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="fraction of each GPU the workers on it may use, weights and KV "
                          "together (default 0.9; workers sharing a GPU split it)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=None, help="decode batch size cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget (prefill chunk size)")
    p.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="at most this many prompt tokens of one request per step (default: "
                        "the whole budget): a short prompt or a prefix hit behind a long "
                        "prompt starts the next step instead of after it")
    p.add_argument("--first-token-first", action=argparse.BooleanOptionalAction, default=None,
                   help="a step that can finish an arriving prompt leaves the running decodes "
                        "out (they run the next step): first token after the prompt's own "
                        "compute")
    p.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=None,
                   help="engines run fewer threads while other processes take their threads' "
                        "time, and their planned count again once they stop (default on)")
    p.add_argument("--decode-step-prefill-tokens", type=int, default=None,
                   help="decode (and colocated) workers compute at most this many prompt "
                        "tokens a step, so streams running there still get a token each step "
                        "while a moved stream is rebuilt (default: 64 on a disaggregated decode "
                        "worker, no cap on a colocated one; >= --max-num-batched-tokens: none)")
    p.add_argument("--yield-step-prefill-tokens", type=int, default=None,
                   help="while requests of a higher priority were queued in the last minute, "
                        "a step computes at most this many prompt tokens of lower ones, so a "
                        "higher-priority prompt arriving mid-step waits for a short one "
                        "(default 256; 0: no such limit)")
    p.add_argument("--prefill-block-size", type=int, default=None)
    p.add_argument("--decode-block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="tensor-parallel ranks per prefill worker (default 1): one process "
                        "each, one GPU each on GPU nodes, all on the worker's node")
    p.add_argument("--decode-tp", type=int, default=None,
                   help="tensor-parallel ranks per decode (or colocated) worker (default 1); "
                        "KV moves between any prefill and decode TP sizes")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests in flight before RESOURCE_EXHAUSTED / 429")
    p.add_argument("--drain-grace-s", type=float, default=None)
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="how the model writes tool calls, for tool_choice auto (default: read "
                        "off its chat template; none there: auto is refused)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a reasoning model's <think> span out of chat output into "
                        "reasoning_content (qwen3, deepseek_r1; default: off)")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads of every worker (default: a split measured per machine "
                        "size, printed at start-up: router/cluster/threads.py)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="threads of each prefill worker, over --threads-per-worker")
    p.add_argument("--decode-threads", type=int, default=None,
                   help="threads of each decode (or colocated) worker, over --threads-per-worker")
    p.add_argument("--kv-host", default=None,
                   help="address every worker binds and advertises for KV transfer (default: "
                        "$PDCLUSTER_KV_HOST of its node, else its Ray node IP; loopback when "
                        "all workers share one host)")
    p.add_argument("--kv-interface", default=None,
                   help="advertise this network interface's IPv4 on each node instead "
                        "(e.g. a second NIC for KV traffic)")


def _add_embedding_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("embeddings (/v1/embeddings; docs/embeddings.md)")
    g.add_argument("--pooling", choices=list(POOLING_CHOICES), default=None,
                   help="how a prompt's final hidden states become one vector: last (the "
                        "default: the last token's, what a decoder LM has read the whole "
                        "prompt at), mean, or cls (the first token's)")
    g.add_argument("--normalize-embeddings", action=argparse.BooleanOptionalAction,
                   default=None, help="L2-normalize embeddings (default: yes)")


def _add_lifecycle_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--startup-timeout-s", type=float, default=None,
                   help="fail start-up if a worker is not up by then (default 300)")
    p.add_argument("--migration-limit", type=int, default=None,
                   help="times a request may move to another decode worker when its own dies "
                        "(default 3; 0 fails its stream instead)")
    p.add_argument("--migration-prefill", choices=("auto", "prefill", "decode"), default=None,
                   help="disaggregated: where a moved stream's prompt and tokens so far are "
                        "computed again: a prefill worker (KV sent over), its new decode worker "
                        "(one step there), or auto (default: a prefill worker if one is idle)")
    p.add_argument("--suspect-after-s", type=float, default=None,
                   help="a decode worker that answers no heartbeat and sends no token this "
                        "long while it holds streams has them moved to another worker "
                        "(default 1; 0: only after 5 s of missed load reports)")
    p.add_argument("--orphan-after-s", type=float, default=None,
                   help="a resumed stream that grows no more for this long, held by no live "
                        "decode worker (its router and decode worker both died), is continued "
                        "by the router it was resumed on (default 20)")
    p.add_argument("--name", default=None,
                   help="the deployment's name (default pdcluster). With --ray-address its "
                        "workers outlive this router; a router started with the same name "
                        "re-attaches to them (no model load)")
    p.add_argument("--keep-workers", action="store_true", default=None,
                   help="with --ray-address: leave the workers running when this router stops "
                        "(a router upgrade: the next one re-attaches; `pdcluster stop` ends "
                        "them). Without it a graceful stop ends them; a crash never does")
    p.add_argument("--worker-restarts", type=int, default=None,
                   help="times Ray restarts a worker whose process died; it rejoins under its "
                        "id with a new KV port (default 3; 0 leaves it dead)")


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    auto = p.add_argument_group("autoscaling (docs/deployment.md, Autoscaling)")
    auto.add_argument("--autoscale", action="store_true", default=None,
                      help="add and drain workers with the load, between the bounds below "
                           "(default: the start counts)")
    for role in ("prefill", "decode"):
        for end in ("min", "max"):
            auto.add_argument(f"--{end}-{role}-workers", type=int, default=None,
                              help=f"{end}imum {role} workers with --autoscale")
    auto.add_argument("--autoscale-target", type=float, default=None,
                      help="utilization each worker is kept near (default 0.7)")
    auto.add_argument("--autoscale-interval-s", type=float, default=None,
                      help="seconds between measurements (default 5)")
    auto.add_argument("--autoscale-up-window-s", type=float, default=None,
                      help="a role grows once the load asked for it this long (default 15)")
    auto.add_argument("--autoscale-down-window-s", type=float, default=None,
                      help="... shrinks by one once it asked for less this long (default 60)")
    auto.add_argument("--autoscale-cooldown-s", type=float, default=None,
                      help="no change of a role for this long after one (default 60)")
    auto.add_argument("--autoscale-migrate-after-s", type=float, default=None,
                      help="a drained decode worker's streams still running after this "
                           "migrate (default 30)")
    auto.add_argument("--autoscale-profile", default=None, metavar="PROFILE.json",
                      help="a `pdcluster profile [--served]` of this host and model: a "
                           "prefill worker's load is priced at its rate until the router has "
                           "measured the worker's own (default: a prior of 1000 tokens/s)")

    rt = p.add_argument_group("routing (docs/architecture.md, KV-aware routing)")
    rt.add_argument("--routing", choices=["kv_aware", "load", "round_robin"], default=None,
                    help="kv_aware (default): lowest cost = prefix-weight x prompt tokens the "
                         "worker does not cache + queue-weight x prompt tokens queued there + "
                         "kv-usage-weight x its KV use fraction x prompt length; load: most "
                         "free KV / least queued; round_robin: in turns")
    rt.add_argument("--prefix-weight", type=float, default=None, help="kv_aware (default 1)")
    rt.add_argument("--queue-weight", type=float, default=None, help="kv_aware (default 1)")
    rt.add_argument("--kv-usage-weight", type=float, default=None, help="kv_aware (default 1)")
    rt.add_argument("--prefix-pull", choices=["auto", "always", "off"], default=None,
                    help="a prefill worker lacking a prefix another worker holds pulls its KV "
                         "over the KV transport instead of computing it: auto (default) when "
                         "the measured transfer rate beats its measured prefill rate; always; "
                         "off")
    rt.add_argument("--kv-event-bus", choices=["auto", "memory"], default=None,
                    help="how workers' KV events reach the router: auto (default) = Redis "
                         "Streams with --redis-url (workers get its URL and must reach it), "
                         "else pulled from the workers; memory = always pulled (workers never "
                         "talk to Redis)")


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    sec = p.add_argument_group("security (docs/security.md)")
    sec.add_argument("--api-keys", default=None,
                     help="file of API keys, one per line, optionally 'name:key' (or "
                          "$PDCLUSTER_API_KEYS_FILE); callers send 'Authorization: Bearer KEY'")
    sec.add_argument("--tenant-weights", default=None, metavar="NAME=W,...",
                     help="each tenant's weight in the fair share of decode room while requests "
                          "wait for it, e.g. 'gold=3,free=1' (a tenant not named weighs 1)")
    sec.add_argument("--tenant-deadlines", default=None, metavar="NAME=S,...",
                     help="seconds a tenant's requests wait at most when they name no deadline "
                          "('*' for every other tenant): one predicted to miss it is refused at "
                          "once with 429 + Retry-After")
    sec.add_argument("--metrics-public", action="store_true", default=None,
                     help="serve /metrics without a key (default: only when there are no keys)")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate chain: HTTPS and gRPC TLS")
    sec.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None,
                     help="PEM CA: require client certificates it signed (mTLS)")
    sec.add_argument("--max-request-bytes", default=None,
                     help="largest request body / gRPC message (default 1MiB): 413")
    sec.add_argument("--rate-limit", type=float, default=None,
                     help="generations per second per API key (0: none): 429 + Retry-After")
    sec.add_argument("--max-concurrent-per-key", type=int, default=None,
                     help="generations running at once per API key (0: no cap): 429")
    sec.add_argument("--admin-tenants", default=None,
                     help="comma-separated key names (tenants) that may make operators' "
                          "calls, e.g. drain a worker (with --api-keys; without keys anyone "
                          "may): others get 403")


def _add_observability_flags(p: argparse.ArgumentParser) -> None:
    obs = p.add_argument_group("observability (docs/observability.md)")
    obs.add_argument("--otlp-traces-endpoint", default=None,
                     help="OTLP/gRPC collector for per-request traces, http://host:4317 (or "
                          "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); default: no tracing")
    obs.add_argument("--trace-sample-ratio", type=float, default=None,
                     help="share of requests traced, 0..1 (default 1; a client's sampled "
                          "traceparent is always followed)")


def cmd_serve(args: argparse.Namespace) -> int:
    from router.cli.serve_config import serve_config_from_args

    return run_serve(serve_config_from_args(args))


def run_serve(config) -> int:
    """Start the cluster and the front doors for a ``ServeConfig``; drain on SIGTERM before
    shutting every worker down."""
    return asyncio.run(_serve(config))


async def _serve(config) -> int:
    from tqdm import tqdm

    from router.cluster.ray_cluster import Cluster
    from router.frontdoor.lifecycle import install_signal_handlers, serve_frontdoor
    from router.frontdoor.security import Gate

    cc = config.cluster_config()
    gate = Gate.from_config(config.security_config())  # a bad key file fails before any work
    if gate.config.tls is not None:
        gate.config.tls.read()
    total = 2 + cc.num_prefill_workers + cc.num_decode_workers
    bar = tqdm(total=total, desc="starting pdcluster", unit="step")

    def progress(step: str) -> None:
        bar.set_postfix_str(step)
        bar.update(1)

    try:
        cluster = await Cluster.start(cc, on_progress=progress)
    finally:
        bar.close()
    try:
        fd = await serve_frontdoor(cluster, host=config.host, grpc_port=config.grpc_port,
                                   http_port=config.http_port, drain_grace_s=config.drain_grace_s,
                                   gate=gate, tool_call_parser=config.tool_call_parser,
                                   reasoning_parser=config.reasoning_parser,
                                   response_store=cluster.store)
        install_signal_handlers(fd)
        # The router's start-up heap (Ray, grpc, the tokenizer: ~340k objects) out of full
        # collections, which would otherwise stop every stream on this loop for ~200 ms.
        from worker_protocol import freeze_startup_heap

        freeze_startup_heap()
        info = cluster.model_info()
        print(f"pdcluster serving {info.model_id} ({config.mode}, {cc.num_prefill_workers} prefill + "
              f"{cc.num_decode_workers} decode workers)\n"
              f"  gRPC  {config.host}:{fd.grpc_port}\n"
              f"  HTTP  {'https' if gate.config.tls else 'http'}://{config.host}:{fd.http_port}/v1"
              f"  (metrics: /metrics)\n"
              f"  API keys: {'required' if gate.auth_required else 'off (anyone who reaches the ports may call)'}\n"
              f"  threads: {config.thread_plan().summary}",
              flush=True)
        await fd.wait_closed()
    finally:
        await cluster.shutdown()
    print("pdcluster stopped", flush=True)
    return 0

