"""Fault scenarios of test_multihost.py, run ON the simulated head host (``ip netns exec``).

``python multihost_driver.py SCENARIO CONFIG_JSON`` joins the simulated Ray cluster, starts a
pdcluster ``Cluster`` over the Python API (fault knobs that `pdcluster serve` does not
expose), plays the scenario and prints one JSON line with what the test asserts on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import EngineArgs, SamplingParams  # noqa: E402
from router.cluster.ray_cluster import Cluster, ClusterConfig  # noqa: E402
from router.contract import GenerateInput  # noqa: E402
from router.routing.policy import RoutingConfig  # noqa: E402

MiB = 1 << 20


def _config(cfg: dict, **kw) -> ClusterConfig:
    base = dict(model=cfg["model"], ray_address=os.environ.get("RAY_ADDRESS", "auto"),
                num_prefill_workers=2, num_decode_workers=2,
                prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8,
                                          kv_cache_memory_bytes=16 * MiB),
                decode_engine=EngineArgs(block_size=8, num_threads=1,
                                         kv_cache_memory_bytes=16 * MiB),
                transfer_timeout_s=cfg.get("transfer_timeout_s", 4.0), lease_s=8.0,
                capacity_wait_s=10.0, call_timeout_s=3.0)
    base.update(kw)
    return ClusterConfig(**base)


async def _collect(cluster: Cluster, prompt: list[int], max_tokens: int, rid: str) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    toks: list[int] = []
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
        toks += ch.token_ids
    return toks


def _journal(cluster: Cluster, rid: str) -> list[dict]:
    return [asdict(e) for e in cluster.store.journal_get(rid)]


async def _held(cluster: Cluster, timeout_s: float = 30.0) -> dict:
    """Workers still holding KV blocks, after waiting up to ``timeout_s`` for leases."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await cluster.worker_loads()
        held = {lo.worker_id: [lo.kv_blocks_used, lo.kv_blocks_reserved] for lo in loads
                if lo.kv_blocks_used or lo.kv_blocks_reserved}
        if not held or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


async def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return value


def _link(cfg: dict, host_ip: str, state: str) -> None:
    subprocess.run(["ip", "netns", "exec", cfg["switch"], "ip", "link", "set",
                    cfg["ports"][host_ip], state], check=True)


async def link_down(cfg: dict) -> dict:
    # Each layer's send is held 0.75 s, so the transfer is surely in flight when the link goes.
    # Load routing: the two requests sent after the cut must land one on each decode worker
    # (kv_aware would send both to the one that already holds their prompt).
    slow = {"fault_delay_per_layer_s": 0.75}
    cluster = await Cluster.start(_config(cfg, worker_overrides={"prefill-0": slow,
                                                                 "prefill-1": slow},
                                          routing=RoutingConfig("load")))
    try:
        hosts = {w.id: w.host for w in await cluster.cluster_status()}
        task = asyncio.ensure_future(_collect(cluster, cfg["prompt"], cfg["max_tokens"], "cut"))

        async def reserved():
            return [e for e in _journal(cluster, "cut") if e["kind"] == "reserved"]

        first = (await _until(reserved, 60, "the first reservation"))[0]
        decode_id, prefill_id = first["worker_id"], first["detail"].split()[-1]
        decode = cluster.worker_handle(decode_id)

        async def joined():  # the pair is up: the first layer is on its way
            pairs = await decode.kv_pairs.remote()
            return pairs.get(prefill_id)

        before_gen = await _until(joined, 30, "the KV pair to join")
        _link(cfg, hosts[decode_id], "down")
        try:
            tokens = await asyncio.wait_for(task, 90)
        finally:
            _link(cfg, hosts[decode_id], "up")
        # The cut host is reachable again: its load reports resume, and new transfers to it
        # build a new pair generation. Two at once, so one of them lands on each decode worker.
        await _until(lambda: cluster.worker_ready(decode_id), 60, f"{decode_id} to be ready")
        received_before = (await decode.load.remote()).kv_transfer_bytes
        after = await asyncio.gather(_collect(cluster, cfg["prompt"], cfg["max_tokens"], "a1"),
                                     _collect(cluster, cfg["prompt"], cfg["max_tokens"], "a2"))
        pairs_after = await decode.kv_pairs.remote()
        received_after = (await decode.load.remote()).kv_transfer_bytes
        return {"tokens": tokens, "journal": _journal(cluster, "cut"), "cut_decode": decode_id,
                "cut_host": hosts[decode_id],
                "after": {"tokens": after[0] if after[0] == after[1] else after,
                          "generation": pairs_after.get(prefill_id, 0),
                          "received_bytes": received_after - received_before},
                "before_generation": before_gen, "held": await _held(cluster)}
    finally:
        await cluster.shutdown()


async def unreachable(cfg: dict) -> dict:
    # Under load routing decode-0 wins ties, so the first request is reserved there and must
    # route around it.
    cluster = await Cluster.start(_config(
        cfg, worker_overrides={"decode-0": {"kv_host": cfg["bogus_host"]}},
        routing=RoutingConfig("load")))
    try:
        prompts, n = cfg["prompts"], cfg["max_tokens"]
        t0 = time.time()
        tokens = [await _collect(cluster, prompts[0], n, "u0")]
        first = _journal(cluster, "u0")
        retried = [e["ts"] for e in first if e["kind"] == "retried"]
        tokens += await asyncio.gather(*[_collect(cluster, p, n, f"u{i}")
                                         for i, p in enumerate(prompts[1:], 1)])
        return {"tokens": tokens, "bogus_worker": "decode-0",
                "journals": [_journal(cluster, f"u{i}") for i in range(len(prompts))],
                "failed_attempt_s": (retried[0] - t0) if retried else None,
                "held": await _held(cluster)}
    finally:
        await cluster.shutdown()


def main() -> None:
    scenario, cfg = sys.argv[1], json.loads(sys.argv[2])
    result = asyncio.run({"link_down": link_down, "unreachable": unreachable}[scenario](cfg))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
