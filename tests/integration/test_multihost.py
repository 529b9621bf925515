"""Multi-host disaggregation on simulated hosts (docs/deployment.md, "Three simulated hosts on
one machine"): three network namespaces on a private bridge, each its own IP and Ray node, KV
crossing between them.

  head     10.231.N.1  Ray head + router + both prefill workers   {"router", "prefill_slot": 2}
  decode-a 10.231.N.2  one decode worker                          {"decode_slot": 1}
  decode-b 10.231.N.3  one decode worker                          {"decode_slot": 1}

Everything the router side does runs on the head host (``ip netns exec``): `pdcluster serve`
with real gRPC / HTTP clients, or ``multihost_driver.py`` over the Python API for the fault
scenarios. Every process lives in a namespace the module creates; ``SimCluster.close`` ends
them by pid and deletes the namespaces. Skips (with the reason) only where namespaces cannot
be created.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cluster.simhosts import HostSpec, SimCluster, unavailable_reason
from engine import LLM, SamplingParams
from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.helpers.tiny_models import random_prompts

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("multihost_driver.py")
MAX_TOKENS = 8
GRPC_PORT, HTTP_PORT = 50051, 8000  # each namespace has its own ports

_REASON = unavailable_reason()


@pytest.fixture(scope="module")
def sim():
    if _REASON:
        pytest.skip(f"simulated hosts unavailable: {_REASON}")
    cluster = SimCluster([
        HostSpec("head", {"router": 1, PREFILL_RESOURCE: 2}, num_cpus=4),
        HostSpec("decode-a", {DECODE_RESOURCE: 1}, num_cpus=2),
        HostSpec("decode-b", {DECODE_RESOURCE: 1}, num_cpus=2),
    ])
    with cluster:
        cluster.start_ray()
        yield cluster


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    """16 prompts and what colocated serving on ONE host answers (the engine in-process)."""
    prompts = random_prompts(seed=11, count=16, max_len=60, min_len=8)
    llm = LLM(str(tiny_llama_dir), block_size=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


def _python(sim: SimCluster, code_or_path: str, *args: str, timeout_s: float = 240.0):
    argv = [sys.executable, *(["-c", code_or_path] if "\n" in code_or_path else [code_or_path]),
            *args]
    res = sim.run("head", argv, timeout_s=timeout_s, cwd=REPO_ROOT,
                  env={"RAY_ADDRESS": sim.ray_address})
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


CLIENT = """
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from client import Client, RetryPolicy

prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
no_retry = RetryPolicy(max_retries=0)  # a retried UNAVAILABLE would hide a router that refused
with Client("127.0.0.1:GRPC_PORT", retry=no_retry) as c, ThreadPoolExecutor(len(prompts)) as ex:
    futs = [ex.submit(c.generate, prompt_token_ids=p, max_tokens=max_tokens, temperature=0,
                      ignore_eos=True, timeout=180) for p in prompts]
    tokens = [f.result().token_ids for f in futs]

def cluster():
    return json.load(urllib.request.urlopen("http://127.0.0.1:HTTP_PORT/v1/cluster", timeout=10))

def settled(workers):  # load reports lag by up to a refresh: wait until they caught up
    moved = {role: sum(w["kv_transfer_bytes"] for w in workers if w["role"] == role)
             for role in ("prefill", "decode")}
    return not any(w["kv_blocks_used"] for w in workers) and moved["prefill"] == moved["decode"] > 0

deadline = time.monotonic() + 30
while not settled(cluster()["workers"]) and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"tokens": tokens, "cluster": cluster()}))
""".replace("GRPC_PORT", str(GRPC_PORT)).replace("HTTP_PORT", str(HTTP_PORT))


def test_serve_across_three_hosts_matches_one_host(sim, workload, tiny_llama_dir, tmp_path):
    """2 prefill + 2 decode workers on 3 hosts, 16 concurrent requests over gRPC: the tokens
    equal colocated serving on one host, each worker runs on the host its role resource
    names, KV bytes are counted on both ends, and no block stays in use."""
    prompts, refs = workload
    log = tmp_path / "serve.log"
    serve = sim.popen("head", [
        sys.executable, "-m", "router.cli", "--log-level", "INFO", "serve",
        "--ray-address", sim.ray_address, "--model", str(tiny_llama_dir),
        "--prefill-workers", "2", "--decode-workers", "2", "--decode-block-size", "8",
        "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
        "--kv-cache-memory", "16MiB", "--threads-per-worker", "1"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 240
        while "pdcluster serving" not in log.read_text():
            assert serve.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        out = _python(sim, CLIENT, json.dumps(prompts), str(MAX_TOKENS))
        status = sim.run("head", [sys.executable, "-m", "router.cli", "status",
                                  "--http-address", f"127.0.0.1:{HTTP_PORT}"], cwd=REPO_ROOT)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(90) == 0, log.read_text()[-4000:]
    finally:
        if serve.poll() is None:
            serve.kill()
    assert out["tokens"] == refs

    workers = {w["id"]: w for w in out["cluster"]["workers"]}
    head, a, b = (sim.host(n).ip for n in ("head", "decode-a", "decode-b"))
    assert {w: workers[w]["host"] for w in ("prefill-0", "prefill-1")} == {
        "prefill-0": head, "prefill-1": head}
    assert sorted(workers[w]["host"] for w in ("decode-0", "decode-1")) == sorted([a, b])
    assert all(w["state"] == "ready" and w["kv_blocks_used"] == 0 for w in workers.values())
    sent = sum(workers[w]["kv_transfer_bytes"] for w in ("prefill-0", "prefill-1"))
    received = sum(workers[w]["kv_transfer_bytes"] for w in ("decode-0", "decode-1"))
    assert sent == received > 0
    # every decode worker took part: both hosts' links carried KV
    assert all(workers[w]["kv_transfer_bytes"] > 0 for w in ("decode-0", "decode-1"))

    assert status.returncode == 0, status.stderr
    for w in workers.values():
        assert f"{w['id']}" in status.stdout and w["host"] in status.stdout


def test_link_down_mid_transfer_retries_on_another_pair(sim, workload, tiny_llama_dir):
    """A decode host's link goes down while its prompt KV is in flight: the request is
    retried on the other decode host and completes with the same tokens, the broken pair is
    retired (the next transfer to that host uses a new generation), nothing leaks."""
    prompts, refs = workload
    res = _python(sim, str(DRIVER), "link_down", json.dumps({
        "model": str(tiny_llama_dir), "prompt": prompts[0], "max_tokens": MAX_TOKENS,
        "switch": sim.switch, "ports": {h.ip: h.switch_port for h in sim.hosts}}))
    assert res["tokens"] == refs[0]
    assert res["cut_host"] in (sim.host("decode-a").ip, sim.host("decode-b").ip)
    kinds = [e["kind"] for e in res["journal"]]
    assert "retried" in kinds
    reserved_on = [e["worker_id"] for e in res["journal"] if e["kind"] == "reserved"]
    committed_on = [e["worker_id"] for e in res["journal"] if e["kind"] == "committed"]
    assert committed_on == [reserved_on[-1]] and reserved_on[0] != reserved_on[-1]
    assert res["cut_decode"] == reserved_on[0]
    # The stalled pair was retired: that generation is no longer live on the cut host, and
    # after the link came back the host took KV again (over a new pair generation).
    assert res["after"]["tokens"] == refs[0]
    assert res["after"]["generation"] != res["before_generation"]
    assert res["after"]["received_bytes"] > 0
    assert res["held"] == {}


def test_unreachable_kv_address_fails_fast_naming_it_and_is_routed_around(sim, workload,
                                                                          tiny_llama_dir):
    """A decode worker advertises an address nobody can reach: the handshake fails within
    its deadline with an error naming the address, the request completes on the other
    decode worker, and later requests are not sent to the unreachable one."""
    prompts, refs = workload
    bogus = f"{sim.subnet}.99"  # in the subnet, on no host
    res = _python(sim, str(DRIVER), "unreachable", json.dumps({
        "model": str(tiny_llama_dir), "prompts": prompts[:4], "max_tokens": MAX_TOKENS,
        "bogus_host": bogus, "transfer_timeout_s": 4.0}))
    assert res["tokens"] == refs[:4]
    first = res["journals"][0]
    retried = [e for e in first if e["kind"] == "retried"]
    assert retried and bogus in retried[0]["detail"]
    assert res["failed_attempt_s"] < 4.0 + 3.0  # the handshake deadline, plus scheduling slack
    later = [e["worker_id"] for j in res["journals"][1:] for e in j if e["kind"] == "reserved"]
    assert later and res["bogus_worker"] not in later
    assert res["held"] == {}


def test_serve_fails_fast_naming_what_no_node_offers(sim, tiny_llama_dir):
    """Three decode workers on a cluster with two decode slots: `pdcluster serve` exits within
    60 s, naming the resource and every node, instead of waiting forever for placement."""
    t0 = time.monotonic()
    res = sim.run("head", [
        sys.executable, "-m", "router.cli", "serve", "--ray-address", sim.ray_address,
        "--model", str(tiny_llama_dir), "--prefill-workers", "1", "--decode-workers", "3",
        "--grpc-port", "0", "--http-port", "0"], timeout_s=120, cwd=REPO_ROOT)
    assert time.monotonic() - t0 < 60
    assert res.returncode == 1, res.stdout + res.stderr
    err = next(line for line in res.stderr.splitlines() if line.startswith("error: "))
    assert err.startswith("error: 3 decode workers (each decode_slot, 1 CPU) do not fit: room for 2")
    assert all(h.ip in err for h in sim.hosts)


def test_serve_gives_up_joining_an_unreachable_ray_cluster(sim, tiny_llama_dir):
    """Ray alone retries an unreachable GCS for minutes without a word; start-up says so."""
    nowhere = f"{sim.subnet}.99:6379"  # in the subnet, on no host
    t0 = time.monotonic()
    res = sim.run("head", [
        sys.executable, "-m", "router.cli", "serve", "--ray-address", nowhere,
        "--model", str(tiny_llama_dir), "--startup-timeout-s", "3",
        "--grpc-port", "0", "--http-port", "0"], timeout_s=120, cwd=REPO_ROOT)
    assert time.monotonic() - t0 < 45
    assert res.returncode == 1, res.stdout + res.stderr
    err = next(line for line in res.stderr.splitlines() if line.startswith("error: "))
    assert err == (f"error: could not join the Ray cluster at {nowhere} within 3 s (is its head "
                   f"running, and is its GCS port reachable from here?)")
