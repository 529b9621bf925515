"""`pdcluster` command line: serve | status | drain | profile | plan | stop | generate | chat |
bench.

Config is read here once (flags, optionally a YAML file whose keys are the flag names) and
passed down as frozen dataclasses; nothing deeper reads flags or the environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.contract import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None,
                   help="the server's API key (default: $PDCLUSTER_API_KEY)")
    p.add_argument("--tls", action="store_true", help="connect over TLS (HTTPS for status)")
    p.add_argument("--ca-file", default=None,
                   help="PEM CA that signed the server's certificate (implies --tls)")


def _client(args: argparse.Namespace):
    from client import Client

    return Client(args.address, api_key=args.api_key, tls=args.tls, ca_file=args.ca_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    from router.cli.serve import add_serve_subcommand
    add_serve_subcommand(sub)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the model in this process")
    where.add_argument("--address", help="HOST:PORT of a running `pdcluster serve` (gRPC)")
    gen.add_argument("--model", default=None, help="local HF dir or GGUF (with --local)")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, no chat template")
    _add_sampling_args(gen)
    _add_connection_args(gen)
    gen.set_defaults(func=cmd_generate)

    status = sub.add_parser("status", help="the workers of a running server and their state")
    status.add_argument("--http-address", default="127.0.0.1:8000",
                        help="HOST:PORT of the server's HTTP front door")
    status.add_argument("--json", action="store_true", help="print GET /v1/cluster as is")
    _add_connection_args(status)
    status.set_defaults(func=cmd_status)

    from router.cli.top import add_top_subcommand
    add_top_subcommand(sub, _add_connection_args)

    drain = sub.add_parser("drain", help="take a worker of a running server out of service "
                                         "without losing a request (scale-down, maintenance)")
    drain.add_argument("worker_id", help="the worker (as `pdcluster status` lists it)")
    drain.add_argument("--http-address", default="127.0.0.1:8000",
                       help="HOST:PORT of the server's HTTP front door")
    drain.add_argument("--migrate-after", type=float, default=None, metavar="S",
                       help="a decode worker's streams still running S seconds after the start "
                            "move to other workers (default 30)")
    drain.add_argument("--no-wait", action="store_true",
                       help="return once the drain started, not once the worker is drained")
    _add_connection_args(drain)
    drain.set_defaults(func=cmd_drain)

    prof = sub.add_parser("profile", help="measure this host's prefill and decode step times "
                                          "(for planning a cluster): a JSON profile")
    prof.add_argument("--model", default=None, help="local HF dir or GGUF (default: the "
                                                    "default model)")
    prof.add_argument("--threads", type=int, default=1,
                      help="torch threads, as one worker will have (default 1)")
    prof.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    prof.add_argument("--full", action="store_true",
                      help="more points: larger batches and contexts, more repeats "
                           "(default: quick, about 2 minutes for the default model)")
    prof.add_argument("--served", action="store_true",
                      help="measure while serving, on a local 1 prefill + 1 decode cluster: "
                           "the steps as workers take them beside the router and Ray, and "
                           "the first token's fixed cost, how the two workers' steps slow each "
                           "other (what `plan` predicts best with)")
    prof.add_argument("--out", default="profile.json", help="where to write it")
    prof.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="the prefill:decode split with the most goodput per "
                                       "worker within an SLO, searched on a simulator of "
                                       "the cluster driven by a profile")
    plan.add_argument("--profile", required=True, help="from `pdcluster profile --out`")
    plan.add_argument("--workload", required=True,
                      help="a JSONL trace (arrival_s or timestamp ms, prompt_tokens or "
                           "input_length, output_tokens or output_length) or chat | rag | mixed")
    plan.add_argument("--rate", type=float, default=1.0,
                      help="requests/s of a named workload (default 1)")
    plan.add_argument("--duration", type=float, default=300.0,
                      help="seconds of a named workload (default 300)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS")
    plan.add_argument("--max-prefill-workers", type=int, default=4)
    plan.add_argument("--max-decode-workers", type=int, default=4)
    plan.add_argument("--max-num-seqs", default="8,16,32",
                      help="decode batch caps to try (default 8,16,32)")
    plan.add_argument("--mode", default="disaggregated",
                      choices=("disaggregated", "colocated", "both"))
    plan.add_argument("--kv-tokens", type=int, default=None,
                      help="KV pool per decode worker in tokens (default: 1 GiB's worth)")
    plan.add_argument("--cores", type=float, default=None,
                      help="CPU cores the workers share (default: this host's when the "
                           "profile is of a CPU; none shared on GPUs)")
    plan.add_argument("--json", default=None, help="also write every candidate here")
    plan.set_defaults(func=cmd_plan)

    stop = sub.add_parser("stop", help="end a deployment's workers on a Ray cluster (they "
                                       "outlive their routers)")
    stop.add_argument("--ray-address", required=True, help="the Ray cluster (HOST:PORT)")
    stop.add_argument("--name", default="pdcluster", help="the deployment (serve --name)")
    stop.set_defaults(func=cmd_stop)

    chat = sub.add_parser("chat", help="interactive chat with a running server")
    chat.add_argument("--address", default="127.0.0.1:50051")
    chat.add_argument("--system", default=None)
    _add_sampling_args(chat)
    _add_connection_args(chat)
    chat.set_defaults(func=cmd_chat)

    try:
        from bench.cli import add_bench_subcommands
    except ImportError:  # bench is part of the package; absent only in stripped installs
        pass
    else:
        add_bench_subcommands(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    if args.local:
        from engine import LLM

        llm = LLM(args.model)
        prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
        for out in llm.stream([prompt], params):
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    with _client(args) as client:
        if args.raw:
            chunks = client.stream(prompt=args.prompt, **_sampling_kwargs(params))
        else:
            chunks = client.stream(messages=[{"role": "user", "content": args.prompt}],
                                   **_sampling_kwargs(params))
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _sampling_kwargs(params: SamplingParams) -> dict:
    kw = dict(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
              top_k=params.top_k)
    if params.seed is not None:
        kw["seed"] = params.seed
    return kw


_STATUS_COLUMNS = ("id", "role", "host", "pid", "tp", "state", "kv_blocks_used",
                   "kv_blocks_total", "kv_cache_dtype", "kv_block_bytes", "running", "waiting",
                   "restarts")


def cmd_status(args: argparse.Namespace) -> int:
    """GET /v1/cluster and print one row per worker; exit 1 when the server cannot be reached
    or a worker is not ready."""
    import json
    import os
    import ssl
    import urllib.error
    import urllib.request

    tls = args.tls or args.ca_file
    url = f"{'https' if tls else 'http'}://{args.http_address}/v1/cluster"
    key = args.api_key or os.environ.get("PDCLUSTER_API_KEY")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    context = ssl.create_default_context(cafile=args.ca_file) if tls else None
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            body = json.load(resp)
    except (urllib.error.URLError, OSError) as e:
        print(f"error: cannot reach {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        rows = [[str(w.get(c, "")) for c in _STATUS_COLUMNS] for w in body["workers"]]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_STATUS_COLUMNS)]
        for r in [list(_STATUS_COLUMNS), *rows]:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return 0 if all(w["state"] == "ready" for w in body["workers"]) else 1


def cmd_drain(args: argparse.Namespace) -> int:
    """POST /v1/cluster/workers/ID/drain and print its status; exit 0 once drained (or, with
    --no-wait, draining), 1 on an error (its message printed)."""
    import json
    import os
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    tls = args.tls or args.ca_file
    wid = urllib.parse.quote(args.worker_id, safe="")
    url = f"{'https' if tls else 'http'}://{args.http_address}/v1/cluster/workers/{wid}/drain"
    key = args.api_key or os.environ.get("PDCLUSTER_API_KEY")
    body = {"wait": not args.no_wait}
    if args.migrate_after is not None:
        body["migrate_after_s"] = args.migrate_after
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    context = ssl.create_default_context(cafile=args.ca_file) if tls else None
    try:
        # No client deadline when waiting: a drain takes as long as its streams (bounded by
        # --migrate-after plus one re-prefill each).
        with urllib.request.urlopen(req, timeout=None if body["wait"] else 30,
                                    context=context) as resp:
            status = json.load(resp)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        print(f"error: drain of {args.worker_id}: {e.code} {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"error: cannot reach {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    print(f"{status['worker_id']} ({status['role']}): {status['state']} after "
          f"{status['elapsed_s']:.1f} s; {status['streams_finished']} streams finished there, "
          f"{status['streams_migrated']} migrated, {status['remaining']} still running")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure and write the engine profile (engine/tuning/profile.py); print what was measured."""
    from pathlib import Path

    from engine import EngineArgs
    from engine.tuning.profile import ProfileGrid, profile_engine

    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    grid = ProfileGrid.full() if args.full else ProfileGrid.quick()
    progress = lambda msg: print(f"  {msg}", flush=True)  # noqa: E731
    try:
        if args.served:
            if args.device != "cpu":
                raise ValueError("--served measures a local CPU cluster (--device cpu)")
            from router.planning.served_profile import profile_served

            prof = profile_served(args.model, args.threads, grid, progress=progress)
        else:
            from router.planning.loopback import add_loopback

            prof = add_loopback(profile_engine(EngineArgs(model=args.model,
                                                          num_threads=args.threads,
                                                          device=args.device),
                                               grid, progress=progress), progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    Path(args.out).write_text(prof.to_json())
    print(f"wrote {args.out}: {len(prof.prefill)} prefill and {len(prof.decode)} decode points "
          f"of {prof.model_id} on {prof.device} ({args.threads} thread(s)) in "
          f"{prof.wall_s:.0f} s")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Search splits on the simulator (router/planning/) and print the table, best first."""
    import json
    import math
    import os
    from pathlib import Path

    from engine.tuning.profile import EngineProfile
    from router.planning.plan import parse_slo, search, table
    from router.planning.workload import load_workload

    try:
        profile = EngineProfile.load(args.profile)
        slo = parse_slo(args.slo)
        requests = load_workload(args.workload, args.rate, args.duration, args.seed)
        seqs = [int(x) for x in args.max_num_seqs.split(",") if x.strip()]
        if not seqs or min(seqs) < 1 or min(args.max_prefill_workers,
                                            args.max_decode_workers) < 1:
            raise ValueError("--max-num-seqs and the worker maxima must be >= 1")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cores = args.cores
    if cores is None:
        cores = float(os.cpu_count() or 1) if profile.device == "cpu" else math.inf
    kv_tokens = args.kv_tokens or (1 << 30) // profile.kv_bytes_per_token
    modes = ["disaggregated", "colocated"] if args.mode == "both" else [args.mode]
    rows = search(profile, requests, slo, args.max_prefill_workers, args.max_decode_workers,
                  seqs, modes, kv_tokens, cores, profile.num_threads or 1)
    print(f"{len(requests)} requests over {requests[-1].arrival_s:.0f} s; SLO TTFT <= "
          f"{slo[0]:g} s, TPOT <= {slo[1]:g} s; {cores:g} cores shared, "
          f"{profile.num_threads or 1} thread(s) a worker; profile of {profile.model_id}")
    print(table(rows))
    best = rows[0].as_dict()
    print(f"best: {best['prefill']} prefill + {best['decode']} decode, max_num_seqs "
          f"{best['max_num_seqs']}: {best['goodput_rps']:.2f} requests/s within the SLO "
          f"({best['goodput_per_worker']:.3f} per worker)")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    import asyncio

    from router.cluster.launcher import stop_deployment

    names = asyncio.run(stop_deployment(args.ray_address, args.name))
    print(f"stopped {len(names)} workers of {args.name!r}: {', '.join(names) or 'none'}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:

    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = _sampling(args)
    with _client(args) as client:
        while True:
            try:
                line = input("you> ")
            except EOFError:
                break
            if line.strip() in ("/exit", "/quit"):
                break
            messages.append({"role": "user", "content": line})
            sys.stdout.write("assistant> ")
            reply = []
            for chunk in client.stream(messages=messages, **_sampling_kwargs(params)):
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = args.func(args)
        # Commands return an exit code; benchmarks return their result dict (already written).
        return result if isinstance(result, int) else 0
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # start-up failures that name what is missing
        from router.cluster.placement import PlacementError
        from router.cluster.ray_cluster import StartupError
        from router.state.store import StoreUnavailableError

        if not isinstance(e, StartupError | PlacementError | StoreUnavailableError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1

