"""Front-door fixtures: real servers on 127.0.0.1 per test module, over the ``backend`` of
the test's package (``tests/integration/frontdoor/conftest.py``: one per mode for all the
front-door modules).

The servers run on a background asyncio loop (``server_loop``) so tests can use blocking
clients (the SDK's ``Client``, the ``openai`` package) as well as ``asyncio.run`` with the
``AsyncClient``. To run the same tests against another backend (e.g. the Ray cluster),
override ``backend``: it must serve the default chat model (the tests ask it questions) and
have a small queue (``max_num_seqs=4``, ``max_waiting=4``) so that flooding it is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from client import Client, RetryPolicy
from router.contract import BackendStats, GenerationBackend
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import FrontDoor, serve_frontdoor
from tests.helpers.async_util import LoopThread


@pytest.fixture
def own_redis():
    """A redis-server of this test's own on a free port (tests/helpers/redis_server.py);
    killed after."""
    from tests.helpers.redis_server import OwnRedis

    r = OwnRedis()
    r.start()
    yield r
    r.kill()


@pytest.fixture(scope="module")
def shared_ray_loop():
    """A ``LoopThread`` for the module's clusters on this pytest process's shared local Ray
    (tests/helpers/shared_ray.py); at the module's end, no actor of it may still be alive.
    If one is, this module errors and the shared Ray is stopped with it: the next module
    starts a fresh one rather than inherit the leak."""
    from tests.helpers.shared_ray import assert_no_live_actors, ensure_shared_ray, stop_shared_ray

    ensure_shared_ray()
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()
    try:
        assert_no_live_actors()
    except AssertionError:
        stop_shared_ray()
        raise


@pytest.fixture(scope="session")
def server_loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def frontdoor(backend, server_loop) -> FrontDoor:
    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=5))
    yield fd
    server_loop.run(fd.stop(1))


@pytest.fixture(scope="module")
def address(frontdoor) -> str:
    """The module's front door's gRPC address."""
    return f"127.0.0.1:{frontdoor.grpc_port}"


@pytest.fixture(scope="module")
def client(address):
    """The SDK's client on ``address``, retrying nothing: a retried UNAVAILABLE would hide the
    refusal under test."""
    with Client(address, timeout=60, retry=RetryPolicy(max_retries=0)) as c:
        yield c


class KVProbe:
    """Reads ``backend.stats()`` from test threads: are KV blocks held, is anything queued."""

    def __init__(self, backend: GenerationBackend, server_loop: LoopThread) -> None:
        self.backend = backend
        self.server_loop = server_loop

    def stats(self) -> BackendStats:
        return self.server_loop.run(self.backend.stats())

    def blocks_used(self) -> int:
        return sum(w.kv_blocks_used for w in self.stats().workers)

    def wait_until_free(self, timeout_s: float = 20.0) -> None:
        """Poll until no worker holds a KV block or a request; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if all(w.kv_blocks_used == 0 and w.requests_running == 0 and w.requests_waiting == 0
                   for w in stats.workers):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"KV blocks / requests still held {timeout_s} s after the request "
                            f"ended: {stats}")
            time.sleep(0.02)

    def wait_until_used(self, timeout_s: float = 20.0) -> int:
        """Poll until some worker holds KV blocks (a request is running); returns how many."""
        deadline = time.monotonic() + timeout_s
        while True:
            used = self.blocks_used()
            if used:
                return used
            if time.monotonic() > deadline:
                pytest.fail("no KV blocks in use although a request should be running")
            time.sleep(0.01)


@pytest.fixture(scope="module")
def kv_probe(backend, server_loop) -> KVProbe:
    return KVProbe(backend, server_loop)


@contextmanager
def engine_frontdoor(args) -> Iterator[FrontDoor]:
    """Our front door (gRPC and HTTP ports on 127.0.0.1) over an in-process engine of
    ``args``, on its own loop; stopped and shut down afterwards."""
    loop = LoopThread()
    backend = EngineBackend(args)
    fd = loop.run(serve_frontdoor(backend, host="127.0.0.1", grpc_port=0, http_port=0,
                                  drain_grace_s=1))
    try:
        yield fd
    finally:
        loop.run(fd.stop(1))
        loop.run(backend.shutdown())
        loop.close()


@pytest.fixture(scope="module")
def tiny_frontdoor(tiny_llama_dir):
    """The front door over an in-process engine on the tiny model."""
    from engine import EngineArgs

    with engine_frontdoor(EngineArgs(model=str(tiny_llama_dir), max_num_seqs=8)) as fd:
        yield fd


@pytest.fixture(scope="module")
def default_model_frontdoor():
    """The front door over an in-process engine on the default model: its tokenizer turns
    every token into streamed text, as a served model's does (the tiny model's is empty)."""
    from engine import EngineArgs

    with engine_frontdoor(EngineArgs(max_num_seqs=8, num_threads=1)) as fd:
        yield fd


# ---- clients of the module's front door ------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(frontdoor) -> str:
    return f"http://127.0.0.1:{frontdoor.http_port}"


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    """The real ``openai`` client on the front door (no retries: a failure shows as one)."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(backend) -> str:
    return backend.model_info().model_id


@pytest.fixture(scope="module")
def otlp():
    """An OTLP trace receiver on a free port for the module's clusters to export to
    (bench/harness/otlp_receiver.py); tests/integration/frontdoor has its own, per package."""
    from bench.harness.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()
