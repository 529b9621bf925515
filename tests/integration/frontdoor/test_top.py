"""`pdcluster top --once` against a live front door: the rates of requests made while it
watched, every worker of the backend, and the slowest requests, read only from /v1/cluster
and /metrics."""

from __future__ import annotations

import re
import threading

from router.cli.main import main

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
MAX_REQUESTS = 30  # the load's bound: top is read until a window saw one finish, or it ends


def test_top_once_shows_the_requests_it_watched_and_every_worker(http, frontdoor, backend,
                                                                 capsys, kv_probe):
    """Requests run back to back while `top --once` watches 2 s windows: a window in which
    one finished shows a rate above zero and that request among the slowest. A window on a
    busy host may see none finish (a request can outlast 2 s), so top is read window after
    window until one did, for at most the load's own bound (MAX_REQUESTS requests)."""
    ids: list[str] = []
    done = threading.Event()

    def load() -> None:
        for _ in range(MAX_REQUESTS):
            if done.is_set():
                return
            r = http.post("/v1/completions", json=BODY)
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])

    t = threading.Thread(target=load)
    t.start()
    outs: list[str] = []
    try:
        while t.is_alive():
            rc = main(["top", "--once", "--interval", "2",
                       "--http-address", f"127.0.0.1:{frontdoor.http_port}"])
            out = capsys.readouterr().out
            assert rc == 0, out
            outs.append(out)
            if float(re.search(r"([\d.]+) req/s", out).group(1)) > 0:
                break
    finally:
        done.set()
        t.join(60)
    assert not t.is_alive()
    out = outs[-1]
    req_s = float(re.search(r"([\d.]+) req/s", out).group(1))
    tok_s = float(re.search(r"([\d.]+) tok/s", out).group(1))
    assert req_s > 0 and tok_s > 0, outs  # a window saw a request finish before the load ended
    for w in http.get("/v1/cluster").json()["workers"]:
        assert w["id"] in out
    assert any(i in out for i in ids), (ids, out)  # no keys: anyone may see them
    kv_probe.wait_until_free()


def test_top_says_when_the_server_cannot_be_read(capsys):
    assert main(["top", "--once", "--interval", "0.1", "--http-address", "127.0.0.1:9"]) == 1
    assert "cannot read" in capsys.readouterr().err
