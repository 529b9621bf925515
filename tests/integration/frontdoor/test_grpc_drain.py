"""The gRPC front door's drain: in-flight requests finish while new calls are refused at once
with UNAVAILABLE (Resume still answers), a zero grace cancels and frees KV, SIGTERM drains and
exits. Real servers on 127.0.0.1 and the SDK."""

from __future__ import annotations

import time

import pytest

from client import Client, RetryPolicy, Unavailable
from router.frontdoor.lifecycle import serve_frontdoor

PROMPT = "The capital of France is"


def test_drain_finishes_in_flight_requests_then_refuses_new_ones(backend, server_loop, kv_probe):
    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=60))
    address = f"127.0.0.1:{fd.grpc_port}"
    with Client(address, timeout=60, retry=RetryPolicy(max_retries=0)) as c, \
            Client(address, timeout=10, retry=RetryPolicy(max_retries=0)) as other:
        with c.stream(PROMPT, max_tokens=40, ignore_eos=True) as s:
            first = next(s)
            stopping = server_loop.submit(fd.stop())
            # New calls are refused at once (UNAVAILABLE, naming the drain: a client retries
            # elsewhere) while the in-flight stream is still being served.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    other.model_info()
                except Unavailable as e:
                    assert "draining" in str(e)
                    break
            else:
                pytest.fail("the draining server still accepts new calls")
            with pytest.raises(Unavailable, match="draining"):
                other.generate(PROMPT, max_tokens=2)
            assert not stopping.done()
            # Calls about work in flight stay open: following the stream from its start.
            replay = list(other.resume(s.wait_request_id()))
            rest = list(s)
        stopping.result(60)
    server_loop.run(fd.wait_closed())
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 40
    assert [t for c in replay for t in c.token_ids] == \
        first.token_ids + [t for c in rest for t in c.token_ids]
    kv_probe.wait_until_free()


def test_stop_with_zero_grace_cancels_in_flight_and_frees_kv(backend, server_loop, kv_probe):
    fd = server_loop.run(serve_frontdoor(backend, grpc_port=0, http_port=0))
    with Client(f"127.0.0.1:{fd.grpc_port}", timeout=60,
                retry=RetryPolicy(max_retries=0)) as c:
        s = c.stream(PROMPT, max_tokens=400, ignore_eos=True)
        next(s)
        server_loop.run(fd.stop(0))
        with pytest.raises(Unavailable):
            list(s)
    kv_probe.wait_until_free()


_SIGTERM_SERVER = """
import asyncio, sys
from engine.runtime.llm_engine import EngineArgs
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import install_signal_handlers, serve_frontdoor

async def main():
    backend = EngineBackend(EngineArgs(model=sys.argv[1]))
    fd = await serve_frontdoor(backend, grpc_port=0, http_port=0, drain_grace_s=60)
    install_signal_handlers(fd)
    print(fd.grpc_port, flush=True)
    await fd.wait_closed()
    await backend.shutdown()
    print("drained", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tiny_llama_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(_SIGTERM_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)],
                            stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        no_retry = RetryPolicy(max_retries=0)
        with Client(address, timeout=60, retry=no_retry) as c, \
                Client(address, timeout=10, retry=no_retry) as other, \
                c.stream(prompt_token_ids=[1, 2, 3], max_tokens=500, ignore_eos=True) as s:
            first = next(s)
            proc.send_signal(signal.SIGTERM)
            # Refused at once, on the open connection, naming the drain.
            with pytest.raises(Unavailable, match="draining"):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    other.model_info()
            rest = list(s)
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == 500
        assert proc.wait(60) == 0
        assert proc.stdout.read().strip() == "drained"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
