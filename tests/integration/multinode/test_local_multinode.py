"""deploy/ray/local_multinode.sh brings up a real three-node Ray cluster on this machine
(head + prefill node + decode node), an actor asking for the prefill resource lands on the
prefill node, `pdcluster serve` places its workers by role, and `down` leaves none of the
cluster's processes running (one cluster for the package, ``deployment`` in its conftest.py,
which checks what `down` leaves: each start costs ~20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.helpers.multinode import alive, run_script, stop_workers

REPO_ROOT = Path(__file__).resolve().parents[3]

# Runs in a child process: a driver joining the cluster, as `pdcluster serve` would.
PROBE = textwrap.dedent(
    """
    import json, sys, time, ray
    ray.init(address=sys.argv[1], logging_level="ERROR")
    deadline = time.monotonic() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    nodes = [{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]}
             for n in ray.nodes()]

    @ray.remote(num_cpus=0, resources={sys.argv[2]: 1})
    class Where:
        def node_id(self):
            return ray.get_runtime_context().get_node_id()

    landed = ray.get(Where.remote().node_id.remote(), timeout=60)
    print(json.dumps({"nodes": nodes, "landed": landed}))
    """
)


@pytest.mark.slow
def test_up_places_workers_by_role_and_serves(deployment, tmp_path, tiny_llama_dir):
    """`up` brought up three nodes (head, prefill, decode) with their resources; an actor asking
    for the prefill resource lands on the prefill node; `pdcluster serve --ray-address` on
    that cluster runs its prefill worker on the prefill node and its decode worker on the
    decode node, and a request completes. (`down` leaving none of the cluster's processes is
    checked when the package's ``deployment`` ends.)"""
    import re
    import signal
    import socket
    import time

    from client import Client, RetryPolicy

    env, address = deployment.env, deployment.address
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        grpc_port = s.getsockname()[1]
    serve = None
    try:
        assert f"RAY_ADDRESS={address}" in deployment.up_stdout
        assert deployment.pids and all(alive(p) for p in deployment.pids)

        probe = subprocess.run(
            [sys.executable, "-c", PROBE, address, PREFILL_RESOURCE],
            capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path, env=env,
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        result = json.loads(probe.stdout.strip().splitlines()[-1])
        alive_nodes = [n for n in result["nodes"] if n["alive"]]
        assert len(alive_nodes) == 3
        prefill_nodes = [n["id"] for n in alive_nodes
                         if n["resources"].get(PREFILL_RESOURCE) == 2.0]
        decode_nodes = [n["id"] for n in alive_nodes if n["resources"].get(DECODE_RESOURCE) == 2.0]
        router_nodes = [n["id"] for n in alive_nodes if n["resources"].get("router") == 1.0]
        assert len(prefill_nodes) == len(decode_nodes) == len(router_nodes) == 1
        assert len({prefill_nodes[0], decode_nodes[0], router_nodes[0]}) == 3
        assert result["landed"] == prefill_nodes[0]

        log = tmp_path / "serve.log"
        serve = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "--log-level", "INFO", "serve",
             "--ray-address", address, "--model", str(tiny_llama_dir), "--grpc-port", str(grpc_port),
             "--http-port", "0", "--kv-cache-memory", "16MiB"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        deadline = time.monotonic() + 180
        while "pdcluster serving" not in log.read_text():
            assert serve.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        placed = dict(re.findall(r"worker (\S+) role=\S+ node=(\S+)", log.read_text()))
        assert placed == {"prefill-0": prefill_nodes[0], "decode-0": decode_nodes[0]}
        # No retries: a retried UNAVAILABLE would hide a router that refused.
        with Client(f"127.0.0.1:{grpc_port}", retry=RetryPolicy(max_retries=0)) as c:
            res = c.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0,
                             ignore_eos=True, timeout=60)
        assert len(res.token_ids) == 6 and res.finish_reason == "length"
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()  # a killed router leaves its workers on the package's Ray:
            serve.wait(30)
            stop_workers(address, "pdcluster", env)  # stopped, or they hold the nodes


@pytest.mark.slow
def test_netns_mode_builds_three_hosts_and_down_removes_them(tmp_path):
    """`up --netns`: three simulated hosts (own network namespace and IP each), one Ray node
    on each; a driver on the head host sees three nodes on three addresses and places a
    prefill actor on the prefill host; `down` ends every process and deletes the namespaces."""
    from bench.cluster.simhosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    state_dir = Path("/tmp") / f"pdc-ray-netns-{os.getpid()}"
    env = dict(os.environ, PDC_RAY_STATE_DIR=str(state_dir),
               PDC_RAY_BIN=str(Path(sys.executable).parent / "ray"))
    up = run_script("up", env, "--netns")
    hosts: dict[str, tuple[str, str]] = {}  # name -> (ip, netns)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        for line in up.stdout.splitlines():  # "host decode: 10.231.N.3 (netns pdc-XXXX-2)"
            if line.startswith("host "):
                name, ip, _, ns = line.split()[1:5]
                hosts[name.rstrip(":")] = (ip, ns.rstrip(")"))
        assert set(hosts) == {"head", "prefill", "decode"}
        address = next(line.split("=", 1)[1] for line in up.stdout.splitlines()
                       if line.startswith("RAY_ADDRESS="))
        assert address == f"{hosts['head'][0]}:6379"
        status = run_script("status", env)
        assert status.returncode == 0 and hosts["decode"][1] in status.stdout
        probe = subprocess.run(
            ["ip", "netns", "exec", hosts["head"][1], sys.executable, "-c", PROBE, address,
             PREFILL_RESOURCE], capture_output=True, text=True, timeout=180, check=False,
            cwd=tmp_path, env=dict(env, RAY_AUTH_MODE="disabled"))
        assert probe.returncode == 0, probe.stderr[-3000:]
        result = json.loads(probe.stdout.strip().splitlines()[-1])
        alive_nodes = [n for n in result["nodes"] if n["alive"]]
        assert len(alive_nodes) == 3
        prefill_node = [n["id"] for n in alive_nodes if n["resources"].get(PREFILL_RESOURCE)]
        assert result["landed"] == prefill_node[0]
    finally:
        down = run_script("down", env)
    assert down.returncode == 0, down.stdout + down.stderr
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for _, ns in hosts.values() if ns in netns]
    assert not state_dir.exists()
