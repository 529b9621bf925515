"""LoRA adapters served by a real local cluster (Ray; KV over gloo): the prefill worker computes
each prompt's KV with the request's adapter and the decode worker generates with the same one.
Rows of three adapters and of the base model, mixed in one cluster, stream ``peft``'s greedy
tokens; the same prompt under two adapters shares no KV; adapters load and unload while streams
run (an unload of one in use is refused) and bad adapters are refused naming why; the HTTP
(real ``openai`` client) and gRPC (the SDK) doors list, load, unload and select adapters by
``model``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import Cluster, ClusterConfig
from router.contract import (
    AdapterInUseError,
    GenerateInput,
    InvalidRequestError,
    ModelNotFoundError,
)
from tests.helpers.async_util import assert_no_blocks_held, run_cluster, until
from tests.helpers.lora import ALL_TARGETS, peft_greedy, save_adapter
from tests.helpers.tiny_models import random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Four adapters of the tiny model: q/v, every target (rsLoRA), MLP only, and one more."""
    d = tmp_path_factory.mktemp("served-loras")
    return {
        "qv": save_adapter(tiny_llama_dir, "llama", d / "qv", r=4, alpha=8, seed=11),
        "all": save_adapter(tiny_llama_dir, "llama", d / "all", r=8, alpha=16,
                            targets=ALL_TARGETS, seed=12, use_rslora=True),
        "mlp": save_adapter(tiny_llama_dir, "llama", d / "mlp", r=4, alpha=8,
                            targets=["gate_proj", "up_proj", "down_proj"], seed=13),
        "late": save_adapter(tiny_llama_dir, "llama", d / "late", r=2, alpha=4,
                             targets=["o_proj", "v_proj"], seed=14),
    }


def _engine(**kw) -> EngineArgs:
    # max_loras=4 (vLLM's default is 1): three adapters and the base share running steps;
    # block_size 8 so the 8-40-token prompts fill blocks (adapter-rooted hashes are exercised).
    return EngineArgs(block_size=8, num_threads=1, enable_lora=True, max_loras=4, **kw)


def _config(model_dir, adapters, mode="disaggregated", num_decode_workers=1,
            **kw) -> ClusterConfig:
    return ClusterConfig(model=str(model_dir), mode=mode,
                         num_prefill_workers=1 if mode == "disaggregated" else 0,
                         num_decode_workers=num_decode_workers, prefill_engine=_engine(), decode_engine=_engine(),
                         transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0,
                         lora_modules=(("qv", str(adapters["qv"])),
                                       ("all", str(adapters["all"]))), **kw)


@pytest.fixture(scope="module")
def cluster(loop, tiny_llama_dir, adapters):
    """One disaggregated cluster (1 prefill + 1 decode worker) serving "qv" and "all" from the
    start (--lora-modules); the decode worker pauses 5 ms a step, so a stream of 200 tokens
    is still running while a test loads and unloads adapters."""
    c = loop.run(Cluster.start(_config(
        tiny_llama_dir, adapters,
        worker_overrides={"decode-0": {"fault_delay_per_step_s": 0.005}})), 180)
    yield c
    loop.run(c.shutdown(), 60)


async def _tokens(cluster, prompt, model=None, params=GREEDY, rid=None) -> list[int]:
    toks: list[int] = []
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, model=model,
                                                   request_id=rid)):
        toks += ch.token_ids
    return toks


def _refs(model_dir, adapters, names, prompts, n=MAX_TOKENS):
    return {m: peft_greedy(model_dir, "llama", adapters[m] if m else None, prompts, n)
            for m in names}


def test_three_adapters_and_the_base_mixed_give_pefts_tokens_on_both_sides(
        loop, cluster, tiny_llama_dir, adapters):
    """"mlp" is loaded at run time beside the two served from the start; twelve requests of
    the base and three adapters run at once through prefill and decode workers."""
    prompts = random_prompts(seed=21, count=12, max_len=40, min_len=8)
    names = [None, "qv", "all", "mlp"]
    refs = _refs(tiny_llama_dir, adapters, names, prompts)
    for m in names[1:]:  # each adapter changes what the base model says
        assert refs[m] != refs[None], m
    chosen = [names[i % 4] for i in range(len(prompts))]

    async def body():
        await cluster.load_lora_adapter("mlp", str(adapters["mlp"]))
        outs = await asyncio.gather(*[_tokens(cluster, p, m, rid=f"mix{i}")
                                      for i, (p, m) in enumerate(zip(prompts, chosen,
                                                                     strict=True))])
        await assert_no_blocks_held(cluster)
        return outs, cluster.served_models(), await cluster.stats()

    outs, served, stats = loop.run(body())
    assert outs == [refs[m][i] for i, m in enumerate(chosen)]
    base = cluster.model_info().model_id
    assert [(m.id, m.parent) for m in served] == [(base, None), ("qv", base), ("all", base),
                                                  ("mlp", base)]
    # every worker holds every adapter: the prefill computed with it, the decode generated
    for w in stats.workers:
        assert {"qv", "all", "mlp"} <= set(w.lora_adapters), (w.worker_id, w.lora_adapters)
    assert stats.lora_adapters["mlp"] == (3, 3 * MAX_TOKENS)


def test_the_same_prompt_under_two_adapters_shares_no_kv(loop, cluster, tiny_llama_dir,
                                                         adapters):
    """"qv" then "all" on one 40-token prompt: the second reuses no block of the first on
    either worker, and the router's KV index keys the prompt by adapter; "qv" again reuses
    its own blocks (the cache works: the first two prove no sharing, not no caching)."""
    prompt = random_prompts(seed=22, count=1, max_len=40, min_len=40)[0]
    refs = _refs(tiny_llama_dir, adapters, ["qv", "all"], [prompt])
    orch = cluster.orchestrator
    qv, al = ({a.name: a for a in orch.adapters.adapters()}[n] for n in ("qv", "all"))
    wids = [*orch.prefill, *orch.decode]

    async def hits():
        return sum(w.prefix_hit_tokens for w in (await cluster.stats()).workers)

    async def body():
        h0 = await hits()
        first = await _tokens(cluster, prompt, "qv")
        await until(lambda: _async(orch.kv_index.match(prompt, wids, qv.key)),
                    "the workers' KV events of the qv prompt")
        index_other = orch.kv_index.match(prompt, wids, al.key)
        index_base = orch.kv_index.match(prompt, wids)
        h1 = await hits()
        second = await _tokens(cluster, prompt, "all")
        h2 = await hits()
        third = await _tokens(cluster, prompt, "qv")
        h3 = await hits()
        await assert_no_blocks_held(cluster)
        return first, second, third, index_other, index_base, (h0, h1, h2, h3)

    first, second, third, index_other, index_base, (h0, h1, h2, h3) = loop.run(body())
    assert (first, second, third) == (refs["qv"][0], refs["all"][0], refs["qv"][0])
    assert index_other == {} and index_base == {}
    assert h1 == h0 and h2 == h1  # nothing reused across adapters (or from the base)
    assert h3 - h2 >= 32  # the same adapter again: its 4 full blocks on both workers


async def _async(v):
    return v


def test_load_and_unload_while_streams_run_lose_nothing(loop, cluster, tiny_llama_dir,
                                                        adapters):
    """Two 200-token streams under "qv" run while "late" is loaded and used; unloading "qv"
    is refused while they run (the adapter stays served), succeeds once they finished, and a
    request naming it then is NOT_FOUND; every token equals peft's."""
    prompts = random_prompts(seed=23, count=2, max_len=24, min_len=8)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    refs = _refs(tiny_llama_dir, adapters, ["qv"], prompts, 200)
    late_ref = _refs(tiny_llama_dir, adapters, ["late"], prompts[:1])["late"][0]

    async def body():
        streams = [asyncio.ensure_future(_tokens(cluster, p, "qv", long, f"long{i}"))
                   for i, p in enumerate(prompts)]
        orch = cluster.orchestrator
        await until(lambda: _async(sum(len(orch.streams_on(w)) for w in orch.decode) == 2),
                    "both streams on the decode worker")
        await cluster.load_lora_adapter("late", str(adapters["late"]))
        late = await _tokens(cluster, prompts[0], "late")
        try:
            await cluster.unload_lora_adapter("qv")
            refused = None
        except AdapterInUseError as e:
            refused = str(e)
        running = sum(not s.done() for s in streams)
        outs = await asyncio.gather(*streams)
        served_before = [m.id for m in cluster.served_models()]
        await cluster.unload_lora_adapter("qv")
        try:
            await _tokens(cluster, prompts[0], "qv")
            gone = None
        except ModelNotFoundError as e:
            gone = str(e)
        await cluster.load_lora_adapter("qv", str(adapters["qv"]))  # served again after
        await assert_no_blocks_held(cluster)
        return late, refused, running, outs, served_before, gone

    late, refused, running, outs, served_before, gone = loop.run(body(), 180)
    assert late == late_ref
    assert running == 2, "the streams ended before the unload was tried"
    assert refused is not None and "in use" in refused, refused
    assert outs == refs["qv"]
    assert "qv" in served_before
    assert gone is not None and "'qv'" in gone


def test_bad_adapters_are_refused_naming_why_and_no_worker_keeps_them(
        loop, cluster, tiny_llama_dir, adapters, tmp_path):
    dora = save_adapter(tiny_llama_dir, "llama", tmp_path / "dora", r=4, alpha=8, seed=3,
                        use_dora=True)
    big = save_adapter(tiny_llama_dir, "llama", tmp_path / "big", r=32, alpha=32, seed=4)
    base = cluster.model_info().model_id
    cases = [("dora", str(dora), "DoRA"), ("big", str(big), "exceeds max_lora_rank 16"),
             ("nowhere", str(tmp_path / "missing"), "no such directory"),
             ("qv", str(adapters["mlp"]), "already loaded"),
             (base, str(adapters["mlp"]), "other than the base model")]

    async def body():
        errors = {}
        for name, path, _ in cases:
            try:
                await cluster.load_lora_adapter(name, path)
                errors[name] = None
            except InvalidRequestError as e:
                errors[name] = str(e)
        try:
            await cluster.unload_lora_adapter("never-loaded")
            unknown = None
        except ModelNotFoundError as e:
            unknown = str(e)
        return errors, unknown, await cluster.stats(), [m.id for m in cluster.served_models()]

    errors, unknown, stats, served = loop.run(body())
    for name, _, why in cases:
        assert errors[name] is not None and why in errors[name], (name, errors[name])
    assert unknown is not None and "never-loaded" in unknown
    for w in stats.workers:
        assert not {"dora", "big", "nowhere"} & set(w.lora_adapters), w.lora_adapters
    assert not {"dora", "big", "nowhere"} & set(served)


def test_the_doors_list_load_unload_and_select_adapters(loop, cluster, tiny_llama_dir,
                                                        adapters):
    """HTTP through the real ``openai`` client and vLLM's load/unload routes; gRPC through the
    SDK. ``model`` picks the adapter; responses name it; /metrics counts per adapter."""
    import httpx
    import openai

    from client import Client
    from router.frontdoor.lifecycle import serve_frontdoor

    prompt = random_prompts(seed=24, count=1, max_len=20, min_len=12)[0]
    refs = _refs(tiny_llama_dir, adapters, ["all", "qv", "late"], [prompt])

    def http_and_grpc(http_port: int, grpc_port: int):
        base_url = f"http://127.0.0.1:{http_port}"
        oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        models = {m.id: m.model_extra.get("parent") for m in oa.models.list().data}
        r = oa.completions.create(model="all", prompt=prompt, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
        http_ids = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
        with httpx.Client(base_url=base_url, timeout=60) as h:
            loaded = h.post("/v1/load_lora_adapter",
                            json={"lora_name": "late2", "lora_path": str(adapters["late"])})
            dup = h.post("/v1/load_lora_adapter",
                         json={"lora_name": "late2", "lora_path": str(adapters["late"])})
            unloaded = h.post("/v1/unload_lora_adapter", json={"lora_name": "late2"})
            missing = h.post("/v1/unload_lora_adapter", json={"lora_name": "late2"})
            extra = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x",
                                                          "base_model_name": "y"})
            metrics = h.get("/metrics").text
        with Client(f"127.0.0.1:{grpc_port}") as c:
            grpc_models = [(m.id, m.parent) for m in c.list_models()]
            grpc_ids = c.generate(prompt_token_ids=prompt, model="qv",
                                  max_tokens=MAX_TOKENS, temperature=0,
                                  ignore_eos=True).token_ids
            c.load_lora_adapter("late3", str(adapters["late"]))
            late3 = c.generate(prompt_token_ids=prompt, model="late3", max_tokens=MAX_TOKENS,
                               temperature=0, ignore_eos=True).token_ids
            c.unload_lora_adapter("late3")
        return (models, r.model, http_ids, loaded, dup, unloaded, missing, extra, metrics,
                grpc_models, grpc_ids, late3)

    async def body():
        fd = await serve_frontdoor(cluster, grpc_port=0, http_port=0, drain_grace_s=1)
        try:
            return await asyncio.to_thread(http_and_grpc, fd.http_port, fd.grpc_port)
        finally:
            await fd.stop(1)

    (models, resp_model, http_ids, loaded, dup, unloaded, missing, extra, metrics, grpc_models,
     grpc_ids, late3) = loop.run(body(), 180)
    base = cluster.model_info().model_id
    assert models[base] is None and models["qv"] == base and models["all"] == base
    assert resp_model == "all" and http_ids == refs["all"][0]
    assert loaded.status_code == 200 and "late2" in loaded.text
    assert dup.status_code == 400 and "already loaded" in dup.json()["error"]["message"]
    assert unloaded.status_code == 200
    assert missing.status_code == 404
    assert extra.status_code == 400 and "base_model_name" in extra.json()["error"]["message"]
    assert 'pdcluster_lora_requests_total{adapter="all"}' in metrics
    assert 'pdcluster_lora_adapter_loaded{adapter="qv",role="decode",worker="decode-0"} 1.0' \
        in metrics
    assert (base, None) in grpc_models and ("all", base) in grpc_models
    assert grpc_ids == refs["qv"][0]
    assert late3 == refs["late"][0]


def test_only_admitted_requests_count_toward_their_adapter(loop, cluster):
    """``pdcluster_lora_requests_total`` (the router's count): a request naming an adapter
    that is refused (a token the model lacks, a priority out of range) counts nowhere; an
    admitted one counts once."""
    prompt = random_prompts(seed=26, count=1, max_len=10, min_len=6)[0]

    async def body():
        before = (await cluster.stats()).lora_adapters["qv"][0]
        for bad in (GenerateInput(GREEDY, token_ids=[10 ** 6], model="qv"),
                    GenerateInput(GREEDY, token_ids=prompt, model="qv", priority=5000)):
            with pytest.raises(InvalidRequestError):
                async for _ in cluster.generate(bad):
                    pass
        refused = (await cluster.stats()).lora_adapters["qv"][0]
        await _tokens(cluster, prompt, "qv")
        return before, refused, (await cluster.stats()).lora_adapters["qv"][0]

    before, refused, after = loop.run(body(), 60)
    assert (refused, after) == (before, before + 1)


def test_colocated_workers_serve_adapters_mixed_with_the_base(loop, tiny_llama_dir, adapters):
    """The colocated path (one worker prefills and decodes): the same mix, peft's tokens."""
    prompts = random_prompts(seed=25, count=6, max_len=30, min_len=8)
    names = [None, "qv", "all"]
    refs = _refs(tiny_llama_dir, adapters, names, prompts)
    chosen = [names[i % 3] for i in range(len(prompts))]

    async def body(c):
        outs = await asyncio.gather(*[_tokens(c, p, m) for p, m in zip(prompts, chosen,
                                                                        strict=True)])
        await assert_no_blocks_held(c)
        return outs

    outs = run_cluster(loop, _config(tiny_llama_dir, adapters, mode="colocated"), body)
    assert outs == [refs[m][i] for i, m in enumerate(chosen)]


def test_a_stream_moved_off_a_killed_decode_worker_keeps_its_adapter(loop, tiny_llama_dir,
                                                                     adapters):
    """Streams of two adapters and the base on two decode workers (10 ms a step, so they
    still run at the kill); the worker holding the first is SIGKILLed: its streams are
    computed again under their adapters on the other worker and every client gets peft's
    tokens, no token missing or repeated."""
    import os
    import signal

    prompts = random_prompts(seed=26, count=6, max_len=24, min_len=8)
    names = ["qv", "all", None]
    chosen = [names[i % 3] for i in range(len(prompts))]
    refs = _refs(tiny_llama_dir, adapters, names, prompts, 120)
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    slow = {"fault_delay_per_step_s": 0.01}
    config = _config(tiny_llama_dir, adapters, num_decode_workers=2, migration_prefill="prefill",
                     worker_overrides={"decode-0": slow, "decode-1": slow})

    async def body(c):
        pids = {w.id: w.pid for w in await c.cluster_status()}
        streams = [c.generate(GenerateInput(long, token_ids=p, model=m, request_id=f"m{i}"))
                   for i, (p, m) in enumerate(zip(prompts, chosen, strict=True))]
        got = [[] for _ in prompts]
        for i, s in enumerate(streams):  # every stream committed to a decode worker
            while not got[i]:
                got[i] += (await anext(s)).token_ids
        on = {f"m{i}": c.orchestrator._streams[f"m{i}"].decode_id for i in range(len(prompts))}
        victim = on["m0"]
        os.kill(pids[victim], signal.SIGKILL)

        async def drain(i, s):
            async for ch in s:
                got[i] += ch.token_ids
        await asyncio.wait_for(asyncio.gather(*[drain(i, s) for i, s in enumerate(streams)]),
                               120)
        moved = [chosen[i] for i in range(len(prompts)) if on[f"m{i}"] == victim]
        kinds = {i: [e.kind for e in c.store.journal_get(f"m{i}")] for i in range(len(prompts))
                 if on[f"m{i}"] == victim}
        await assert_no_blocks_held(c, timeout_s=30)
        return got, moved, kinds

    got, moved, kinds = run_cluster(loop, config, body)
    assert "qv" in moved, moved
    assert all(k.count("migrated") == 1 and k[-1] == "finished" for k in kinds.values()), kinds
    assert got == [refs[m][i] for i, m in enumerate(chosen)]


def test_a_decode_worker_holding_one_adapter_queues_another_until_it_frees(
        loop, tiny_llama_dir, adapters):
    """max_cpu_loras 1 on both sides: while a stream under "qv" runs (its adapter in use), a
    request under "all" waits at the decode worker's reservation for "qv" to finish instead of
    failing, then is served; both streams are peft's tokens, and "all" starts only after
    "qv" ended."""
    prompts = random_prompts(seed=27, count=2, max_len=20, min_len=8)
    refs = _refs(tiny_llama_dir, adapters, ["qv", "all"], prompts, 40)
    # One adapter held per worker (the case under test); the rest as _engine's.
    one = EngineArgs(block_size=8, num_threads=1, enable_lora=True, max_loras=1,
                     max_cpu_loras=1)
    config = dataclasses.replace(
        _config(tiny_llama_dir, adapters,
                worker_overrides={"decode-0": {"fault_delay_per_step_s": 0.01}}),
        prefill_engine=one, decode_engine=one)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    events: list[str] = []

    async def run(c, name, prompt, started: asyncio.Event | None):
        toks: list[int] = []
        async for ch in c.generate(GenerateInput(params, token_ids=prompt, model=name)):
            if not toks:
                events.append(f"{name} first")
                if started is not None:
                    started.set()
            toks += ch.token_ids
        events.append(f"{name} done")
        return toks

    async def body(c):
        started = asyncio.Event()
        first = asyncio.create_task(run(c, "qv", prompts[0], started))
        await started.wait()  # "qv" holds the decode worker's one adapter slot
        outs = await asyncio.gather(first, run(c, "all", prompts[1], None))
        await assert_no_blocks_held(c)
        return outs

    outs = run_cluster(loop, config, body)
    assert outs == [refs["qv"][0], refs["all"][1]]
    assert events == ["qv first", "qv done", "all first", "all done"]
