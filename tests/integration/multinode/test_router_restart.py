"""The router is no single point of failure: on the package's three-node Ray (started with
deploy/ray/local_multinode.sh: conftest.py) and its Redis, a `pdcluster serve --ray-address`
router is SIGKILLed with 16 resumable streams mid-way. Its workers live on (detached); a new
router with the same --name re-attaches to them without loading a model, adopts the requests
the dead router left, and every client (the SDK, resume=True) receives exactly the remaining
tokens: each stream equals transformers' greedy run. A router that wants another
configuration replaces the workers that differ; `pdcluster stop` ends a deployment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from client import Client, RetryPolicy
from tests.helpers.multinode import stop_workers
from tests.helpers.redis_server import free_port
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.redis]

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_TOKENS = 300


class Router:
    """One `pdcluster serve` process, ended by its pid."""

    def __init__(self, args: list[str], env: dict, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO_ROOT, start_new_session=True)

    def wait_serving(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while "pdcluster serving" not in self.log_path.read_text():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < timeout_s, self.log_path.read_text()[-3000:]
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _workers(http_port: int) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/cluster", timeout=10) as r:
        return {w["id"]: w for w in json.load(r)["workers"]}


def _start_clients(prompts, addresses):
    """One SDK client per prompt (resume=True), each on its address; returns (tokens so
    far per client, errors, threads)."""
    got: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            # Resumes only (what the test is about): a retried UNAVAILABLE before the first
            # token would hide a router that refused the request.
            resume_only = RetryPolicy(max_retries=0)
            with Client(addresses[i], timeout=240, retry=resume_only) as c, c.stream(
                    prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                    ignore_eos=True, resume=True) as s:
                for chunk in s:
                    got[i] += chunk.token_ids
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    return got, errors, threads


def _wait_all_started(got, errors, min_tokens: int = 5) -> None:
    deadline = time.monotonic() + 120
    while min(len(g) for g in got) < min_tokens:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.01)


def test_router_killed_mid_stream_workers_live_on_and_clients_resume(deployment, tmp_path,
                                                                    tiny_llama_dir):
    env, address, redis = deployment.env, deployment.address, deployment.redis
    routers: list[Router] = []
    stopped = False
    try:
        grpc_port, http_port = free_port(), free_port()
        args = ["--ray-address", address, "--redis-url", redis.url, "--name", "rr",
                "--model", str(tiny_llama_dir), "--prefill-workers", "1", "--decode-workers", "1",
                "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--threads-per-worker", "1",
                "--keep-workers"]

        routers.append(Router(args, env, tmp_path / "router-1.log"))
        routers[0].wait_serving(240)
        before = _workers(http_port)

        prompts = random_prompts(seed=41, count=16, max_len=24, min_len=4)
        refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
        got, errors, threads = _start_clients(prompts, [f"127.0.0.1:{grpc_port}"] * 16)
        _wait_all_started(got, errors)
        routers[0].stop(signal.SIGKILL)  # mid-stream, with no warning
        cut_at = [len(g) for g in got]

        routers.append(Router(args, env, tmp_path / "router-2.log"))
        routers[1].wait_serving(240)
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        after = _workers(http_port)

        assert any(c < MAX_TOKENS for c in cut_at), "every stream ended before the kill"
        assert got == refs  # each client saw exactly the remaining tokens
        # Re-attached, not restarted: the same worker processes, nothing reloaded.
        assert {w: (v["pid"], v["state"]) for w, v in after.items()} == {
            w: (v["pid"], "ready") for w, v in before.items()}

        routers[1].stop()  # graceful, with --keep-workers: they stay for the next router
        # A router that wants another decode configuration (--max-num-seqs 8) replaces the
        # decode worker and re-attaches to the unchanged prefill worker.
        other = [a if a != "16" else "8" for a in args]
        routers.append(Router(other, env, tmp_path / "router-3.log"))
        routers[2].wait_serving(240)
        replaced = _workers(http_port)
        assert replaced["decode-0"]["pid"] != before["decode-0"]["pid"]
        assert replaced["prefill-0"]["pid"] == before["prefill-0"]["pid"]
        _wait_gone(before["decode-0"]["pid"])
        routers[2].stop()
        stop = subprocess.run([sys.executable, "-m", "router.cli", "stop", "--ray-address",
                               address, "--name", "rr"], env=env, capture_output=True,
                              text=True, timeout=120, check=False, cwd=REPO_ROOT)
        assert stop.returncode == 0, stop.stderr[-3000:]
        stopped = True
        assert "stopped 2 workers" in stop.stdout, stop.stdout
        for w in replaced.values():
            _wait_gone(w["pid"])
    finally:
        for r in routers:
            r.stop(signal.SIGKILL)
        if not stopped:  # failed on the way: its detached workers would hold the nodes
            stop_workers(address, "rr", env)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
        if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
            return
        assert time.monotonic() < deadline, f"worker pid {pid} still runs after `pdcluster stop`"
        time.sleep(0.2)


def test_two_routers_front_one_deployment_and_the_survivor_takes_over(deployment,
                                                                       tiny_llama_dir, tmp_path):
    """Active-active: routers A and B with the same --name and Redis front the same workers
    (1 prefill, 2 decode; decode steps slowed so streams last ~18 s) at once, each owning the
    requests it took (8 each). A and decode-0 are SIGKILLed together mid-stream; A's clients'
    load balancer (a proxy) now sends them to B, where they resume:
    - A's requests on decode-1 are handed to B once A stops reporting (B keeps their logs);
      then decode-1 is SIGKILLed too, and B continues them itself (adopted, then lost);
    - A's requests on decode-0 had nobody to hand them over: their resumed logs stop
      growing, and B continues them (orphaned outright; after --orphan-after-s 6 here);
    - B's own requests migrate as usual.
    All 16 streams equal transformers' greedy run."""
    from tests.helpers.tcp_proxy import CuttableProxy

    env, address, redis = deployment.env, deployment.address, deployment.redis
    a_ports, b_ports = (free_port(), free_port()), (free_port(), free_port())
    slow = json.dumps({f"decode-{i}": {"fault_delay_per_step_s": 0.06} for i in range(2)})

    def args(ports):
        return ["--ray-address", address, "--redis-url", redis.url, "--name", "aa",
                "--model", str(tiny_llama_dir), "--prefill-workers", "1", "--decode-workers",
                "2", "--grpc-port", str(ports[0]), "--http-port", str(ports[1]),
                "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--threads-per-worker",
                "1", "--keep-workers", "--worker-overrides", slow, "--orphan-after-s", "6"]

    routers = [Router(args(a_ports), env, tmp_path / "a.log")]
    proxy, stopped = None, False
    try:
        routers[0].wait_serving(240)
        routers.append(Router(args(b_ports), env, tmp_path / "b.log"))
        routers[1].wait_serving(240)
        workers = _workers(b_ports[1])
        assert {w: v["pid"] for w, v in _workers(a_ports[1]).items()} == {
            w: v["pid"] for w, v in workers.items()}  # the same three workers
        proxy = CuttableProxy(a_ports[0])

        prompts = random_prompts(seed=43, count=16, max_len=24, min_len=4)
        refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
        via = [f"127.0.0.1:{proxy.port}"] * 8 + [f"127.0.0.1:{b_ports[0]}"] * 8
        got, errors, threads = _start_clients(prompts, via)
        _wait_all_started(got, errors)
        routers[0].stop(signal.SIGKILL)
        os.kill(workers["decode-0"]["pid"], signal.SIGKILL)
        proxy.target_port = b_ports[0]  # the load balancer now knows only B
        proxy.cut()
        b_log = routers[1].log_path
        deadline = time.monotonic() + 60
        while "(its router is gone)" not in b_log.read_text():  # decode-1 handed A's to B
            assert time.monotonic() < deadline and not errors, (errors, b_log.read_text()[-3000:])
            time.sleep(0.05)
        os.kill(workers["decode-1"]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert got == refs
        text = b_log.read_text()
        assert "adopted, then" in text, text[-3000:]  # continued: its worker died after
        assert "its router and its decode worker are gone" in text, text[-3000:]
        after = _workers(b_ports[1])
        assert all(v["state"] == "ready" for v in after.values()), after
        assert [after[f"decode-{i}"]["restarts"] for i in range(2)] == [1, 1], after
        routers[1].stop()
        stop = subprocess.run([sys.executable, "-m", "router.cli", "stop", "--ray-address",
                               address, "--name", "aa"], env=env, capture_output=True,
                              text=True, timeout=120, check=False, cwd=REPO_ROOT)
        stopped = stop.returncode == 0
        assert "stopped 3 workers" in stop.stdout, stop.stdout + stop.stderr
    finally:
        for r in routers:
            r.stop(signal.SIGKILL)
        if proxy is not None:
            proxy.close()
        if not stopped:  # failed on the way: its detached workers would hold the nodes
            stop_workers(address, "aa", env)
