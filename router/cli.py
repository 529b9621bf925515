"""`pdcluster` command line: serve | generate | chat | bench.

Config is read here once (flags, optionally a YAML file whose keys are the flag names) and
passed down as frozen dataclasses; nothing deeper reads flags or the environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.request import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    from router.serve_cli import add_serve_subcommand
    add_serve_subcommand(sub)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the model in this process")
    where.add_argument("--address", help="HOST:PORT of a running `pdcluster serve` (gRPC)")
    gen.add_argument("--model", default=None, help="local HF dir or GGUF (with --local)")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, no chat template")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with a running server")
    chat.add_argument("--address", default="127.0.0.1:50051")
    chat.add_argument("--system", default=None)
    _add_sampling_args(chat)
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
    from client import Client

    with Client(args.address) as client:
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


def cmd_chat(args: argparse.Namespace) -> int:
    from client import Client

    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = _sampling(args)
    with Client(args.address) as client:
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


if __name__ == "__main__":
    sys.exit(main())
