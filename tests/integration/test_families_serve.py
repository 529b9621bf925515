"""Every model family served as ``pdcluster serve --model DIR`` serves it: the CLI's own parser
and config path (router/cli: flags -> ServeConfig -> ClusterConfig, every default kept, so
disaggregated with 1 prefill + 1 decode worker, kernel timing on, a 1 GiB KV pool each), its
cluster and front doors, and a greedy completion through the real ``openai`` client gives
transformers' greedy tokens.

Why in this process and not ``pdcluster serve`` as a subprocess per family: a subprocess
took 11-17 s per family on a busy 2-core box (interpreter and torch import, Ray start or
join, then the workers), 2-3 min for the ten; here a family's cluster is up in 4-7 s on one
shared local Ray, and it is what ``router.cli.serve._serve`` starts from the same
``ServeConfig``. tests/integration/test_serve_cli.py runs the real process (default model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.async_util import LoopThread, ray_loop
from tests.helpers.tiny_models import GEMMA_WINDOW, hf_greedy, random_prompts

pytestmark = pytest.mark.slow

# Every family with a tiny fixture in tests/conftest.py (tiny_<arch>_dir).
FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral",
            "gemma2", "gemma3"]
MAX_TOKENS = 8


def _serve_args(model_dir) -> list[str]:
    # Ports 0 (a free one each): the defaults 8000 / 50051 may be taken on a shared host.
    return ["serve", "--model", str(model_dir), "--http-port", "0", "--grpc-port", "0"]


def _serve_config(argv: list[str]):
    """The ``ServeConfig`` ``pdcluster <argv>`` runs: the CLI's parser, then its config path."""
    from router.cli.main import build_parser
    from router.cli.serve import cmd_serve
    from router.cli.serve_config import serve_config_from_args

    args = build_parser().parse_args(argv)
    assert args.func is cmd_serve  # the subcommand that would run
    return serve_config_from_args(args)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    """One local Ray for the module's ten clusters, started with the arguments
    ``Cluster.start`` gives ``ray.init`` for the default ``pdcluster serve`` (its CPUs, its
    namespace, one prefill and one decode slot): a cluster that finds Ray running uses it,
    so each family's cluster is the default one without a Ray start of its own (~5 s each)."""
    from router.cluster.launcher import RAY_NAMESPACE
    from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE

    cfg = _serve_config(["serve"]).cluster_config()
    n = (cfg.max_workers("prefill") * cfg.prefill_engine.tensor_parallel_size
         + cfg.max_workers("decode") * cfg.decode_engine.tensor_parallel_size)
    with ray_loop(num_cpus=max(4, int(n * cfg.worker_num_cpus) + 1), namespace=RAY_NAMESPACE,
                  resources={PREFILL_RESOURCE: cfg.max_workers("prefill"),
                             DECODE_RESOURCE: cfg.max_workers("decode")}) as lt:
        yield lt


@contextlib.contextmanager
def served(loop: LoopThread, argv: list[str]) -> Iterator[str]:
    """What ``router.cli.serve._serve`` starts for ``pdcluster <argv>`` (the cluster, the
    security gate, both front doors with the config's host, ports and drain grace) without its
    SIGTERM handlers, which only the main thread may install; yields the HTTP base URL. The
    front door drains and the cluster (its workers) shuts down afterwards, as on SIGTERM."""
    from router.cluster.ray_cluster import Cluster
    from router.frontdoor.lifecycle import serve_frontdoor
    from router.frontdoor.security import Gate

    config = _serve_config(argv)
    cc = config.cluster_config()
    gate = Gate.from_config(config.security_config())
    cluster = loop.run(Cluster.start(cc), 300)
    try:
        fd = loop.run(serve_frontdoor(cluster, host=config.host, grpc_port=config.grpc_port,
                                      http_port=config.http_port,
                                      drain_grace_s=config.drain_grace_s, gate=gate,
                                      tool_call_parser=config.tool_call_parser))
        try:
            yield f"http://{config.host}:{fd.http_port}"
        finally:
            loop.run(fd.stop(1))
    finally:
        loop.run(cluster.shutdown(), 120)


@pytest.mark.parametrize("arch", FAMILIES)
def test_pdcluster_serve_model_dir_gives_transformers_greedy_tokens(loop, arch, request):
    """One token-id prompt of 12-20 tokens (Gemma's sliding window of 8 is outgrown by the
    prompt, which the prefill worker computes, and by the decode worker's steps over the KV it
    received), 8 greedy tokens: the ids the response reports (``logprobs`` with vLLM's
    ``return_tokens_as_token_ids``: the tiny models have no tokenizer, their text is empty)
    equal transformers' ``generate``. ``ignore_eos``: the reference does not stop at EOS."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompt = random_prompts(seed=43, count=1, max_len=20, min_len=GEMMA_WINDOW + 4)[0]
    [expected] = hf_greedy(model_dir, arch, [prompt], MAX_TOKENS)
    with served(loop, _serve_args(model_dir)) as base_url, openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120) as oai:
        model = oai.models.list().data[0].id
        out = oai.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        workers = httpx.get(f"{base_url}/v1/cluster", timeout=30).json()["workers"]
    choice = out.choices[0]
    got = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert got == expected
    assert (choice.finish_reason, out.usage.completion_tokens) == ("length", MAX_TOKENS)
    assert out.usage.prompt_tokens == len(prompt)  # the ids as given: no BOS added
    # The default mode: one prefill and one decode worker, both serving.
    assert sorted((w["role"], w["state"]) for w in workers) == [("decode", "ready"),
                                                                 ("prefill", "ready")]
