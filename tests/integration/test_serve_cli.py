"""`pdcluster serve` as a user runs it: a real process, local Ray, default model, both APIs
behind API keys (the key file from $PDCLUSTER_API_KEYS_FILE, as a Kubernetes Secret gives it;
/metrics public), the CLI's commands with a key, then SIGTERM: it drains, exits 0 and leaves
no Ray process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-serve-cli-test-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(root: int) -> set[int]:
    """PIDs of every process below ``root`` (Ray's GCS, raylet, workers started by serve)."""
    parents: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if os.path.exists(f"/proc/{p}")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port, http_port = _free_port(), _free_port()
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"cli-tests:{KEY}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--max-num-seqs", "8", "--kv-cache-memory", "256MiB",
         "--metrics-public"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PDCLUSTER_API_KEYS_FILE=str(keys)))
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.5)
    yield proc, grpc_port, http_port
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_openai_client_and_sdk_against_the_served_cluster(server):
    from openai import OpenAI

    from client import Client, RetryPolicy

    proc, grpc_port, http_port = server
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="sk-not-this-servers-key",
               max_retries=0).models.list()
    # No retries, here or below: a retried failure would hide what the server refused.
    oai = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0)
    model = oai.models.list().data[0].id
    r = oai.chat.completions.create(
        model=model, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    with Client(f"127.0.0.1:{grpc_port}", api_key=KEY, retry=RetryPolicy(max_retries=0)) as c:
        res = c.chat([{"role": "user", "content": "What is the capital of France?"}],
                     max_tokens=24, temperature=0)
        assert res.text == r.choices[0].message.content  # same greedy answer over both APIs
        stream = c.stream(prompt="Once upon a time", max_tokens=200, ignore_eos=True)
        next(iter(stream))
        stream.close()  # cancels: the server aborts the request and frees its KV
    deadline = time.monotonic() + 20
    while True:
        metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
        used = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("pdcluster_kv_blocks_used{")]
        if used and sum(used) == 0:
            break
        assert time.monotonic() < deadline, f"KV blocks still used after cancel: {used}"
        time.sleep(0.2)
    assert "pdcluster_kv_transfer_bytes_total" in metrics


def test_generate_and_chat_commands_talk_to_the_server(server):
    _, grpc_port, _ = server
    address = f"127.0.0.1:{grpc_port}"
    gen = subprocess.run([sys.executable, "-m", "router.cli", "generate", "--address", address,
                          "What is the capital of France?", "--max-tokens", "24",
                          "--api-key", KEY], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in gen.stdout
    chat = subprocess.run([sys.executable, "-m", "router.cli", "chat", "--address", address,
                           "--max-tokens", "24"],
                          input="What is the capital of France?\n/exit\n",
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PDCLUSTER_API_KEY=KEY))
    assert chat.returncode == 0, chat.stderr
    assert "assistant> " in chat.stdout and "Paris" in chat.stdout


def test_status_command_shows_every_worker(server):
    _, _, http_port = server
    status = [sys.executable, "-m", "router.cli", "status", "--http-address",
              f"127.0.0.1:{http_port}"]
    keyless = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert keyless.returncode == 1 and "Unauthorized" in keyless.stderr, keyless.stderr
    res = subprocess.run(status + ["--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:10] == ["id", "role", "host", "pid", "tp", "state", "kv_blocks_used",
                                     "kv_blocks_total", "kv_cache_dtype", "kv_block_bytes"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"prefill-0", "decode-0"}
    assert all(r[4] == "1" and r[5] == "ready" for r in rows.values())
    # `pdcluster serve`'s default KV cache: the default model's fp32 rows, 46,080 bytes a token
    assert all(r[8] == "auto" and int(r[9]) % 46080 == 0 for r in rows.values())
    down = subprocess.run([sys.executable, "-m", "router.cli", "status", "--http-address",
                           f"127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "cannot reach" in down.stderr


def test_workers_start_with_the_core_splits_environment(server):
    """`pdcluster serve` plans its core split (router.cluster.threads) and the prefill worker's
    process really starts with the environment the plan gives it (Ray runtime_env), the
    decode worker without it."""
    from router.cli.serve_config import ServeConfig

    _, _, http_port = server
    res = subprocess.run([sys.executable, "-m", "router.cli", "status", "--http-address",
                          f"127.0.0.1:{http_port}", "--api-key", KEY],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    pids = {line.split()[0]: int(line.split()[3]) for line in res.stdout.splitlines()[1:]}

    def environ(pid: int) -> dict[str, str]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
        return {k.decode(): v.decode() for k, v in pairs}

    plan = ServeConfig(mode="disaggregated").thread_plan()  # this machine, this environment
    prefill, decode = environ(pids["prefill-0"]), environ(pids["decode-0"])
    for name, value in plan.prefill_env.items():
        assert prefill.get(name) == value
        assert decode.get(name) == os.environ.get(name)  # decode keeps OpenMP's default
    if not plan.prefill_env:  # e.g. an operator's policy, or enough cores: nothing added
        assert prefill.get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")


def test_sigterm_drains_and_exits_cleanly(server):
    proc, _, _ = server
    children = _descendants(proc.pid)
    assert children, "serve should have started Ray processes"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert "pdcluster stopped" in out
    deadline = time.monotonic() + 30
    while _alive(children):
        assert time.monotonic() < deadline, f"processes left behind: {_alive(children)}"
        time.sleep(0.5)
