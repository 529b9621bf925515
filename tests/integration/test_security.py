"""The front doors behind API keys, TLS and mTLS, per-tenant request ids and limits, tried the
way a user meets them: the real ``openai`` client and ``httpx`` over HTTPS, the SDK and raw
gRPC channels over TLS with client certificates, all against certificates this test makes
(tests/helpers/tls_certs.py). Two tenants share one server (an in-process engine with the tiny
model).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from client import (
    AsyncClient,
    Client,
    NotFound,
    ResourceExhausted,
    RetryPolicy,
    Unauthenticated,
    Unavailable,
)
from engine.runtime.llm_engine import EngineArgs
from proto.pdcluster.v1 import generation_pb2 as pb
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc
from router.embedded import EngineBackend
from router.frontdoor.lifecycle import serve_frontdoor
from router.frontdoor.security import Gate, SecurityConfig, TLSConfig
from tests.helpers.tls_certs import TestCA

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-fedcba9876543210"
PROMPT = [5, 6, 7, 8, 9]
MAX_REQUEST_BYTES = 64 * 1024
# Test clients retry nothing: a retried UNAVAILABLE would hide the refusal under test.
NO_RETRY = RetryPolicy(max_retries=0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder)
    server = ca.issue("server")
    clients = {name: ca.issue(name, client=True) for name in ("team-a", "team-b")}
    stranger = TestCA(folder, "another CA").issue("stranger", client=True)
    return ca, server, clients, stranger


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, server_loop):
    b = EngineBackend(EngineArgs(model=str(tiny_llama_dir), max_num_seqs=8))
    yield b
    server_loop.run(b.shutdown(), 60)


def _keys_file(folder) -> str:
    path = folder / "api-keys"
    path.write_text(f"# tenants\nteam-a:{KEY_A}\n\nteam-b: {KEY_B}\n")
    return str(path)


@pytest.fixture(scope="module")
def secure(engine, server_loop, pki, tmp_path_factory):
    """HTTPS + gRPC over mTLS, API keys, at most 2 generations at once per key."""
    ca, server, _, _ = pki
    config = SecurityConfig(_keys_file(tmp_path_factory.mktemp("keys")),
                            max_request_bytes=MAX_REQUEST_BYTES, max_concurrent_per_key=2,
                            tls=TLSConfig(server.cert, server.key, ca.ca_file))
    fd = server_loop.run(serve_frontdoor(engine, grpc_port=0, http_port=0, drain_grace_s=2,
                                         gate=Gate.from_config(config)))
    yield fd
    server_loop.run(fd.stop(1))


def _tls(ca_file: str | None, cert=None) -> ssl.SSLContext:
    """What httpx verifies the server with (``ca_file``; None: the system's roots) and the
    client certificate it presents (``cert``: CertFiles)."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    return ctx


def _http(secure, pki, key: str | None, client: str | None = "team-a") -> httpx.Client:
    ca, _, clients, _ = pki
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"https://127.0.0.1:{secure.http_port}",
                        verify=_tls(ca.ca_file, clients[client] if client else None),
                        headers=headers, timeout=60)


def _sdk(secure, pki, key: str | None, client: str = "team-a") -> Client:
    ca, _, clients, _ = pki
    return Client(f"127.0.0.1:{secure.grpc_port}", api_key=key, ca_file=ca.ca_file,
                  client_cert=clients[client].cert, client_key=clients[client].key, timeout=60,
                  retry=NO_RETRY)


def _creds(pki, client: str) -> grpc.ChannelCredentials:
    ca, _, clients, _ = pki
    return grpc.ssl_channel_credentials(Path(ca.ca_file).read_bytes(),
                                        Path(clients[client].key).read_bytes(),
                                        Path(clients[client].cert).read_bytes())


def test_the_openai_client_needs_a_key_over_https(secure, pki):
    ca, _, clients, _ = pki

    def oai(key):
        http_client = httpx.Client(verify=_tls(ca.ca_file, clients["team-a"]))
        return openai.OpenAI(base_url=f"https://127.0.0.1:{secure.http_port}/v1", api_key=key,
                             max_retries=0, http_client=http_client)

    with oai("sk-not-a-key-of-this-server") as c, pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model="m", prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "sk-not-a-key" not in str(e.value)  # a wrong key is never echoed
    with oai(KEY_A) as c:
        out = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT,
                                   max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4

    with _http(secure, pki, None) as h:
        assert h.get("/health").status_code == 200  # probes need no key
        unauth = h.get("/metrics")
        assert unauth.status_code == 401 and unauth.headers["www-authenticate"] == "Bearer"
        assert h.post("/v1/completions", json={"prompt": PROMPT}).json()["error"]["code"] \
            == "invalid_api_key"
    with _http(secure, pki, KEY_B, "team-b") as h:
        assert h.get("/metrics").status_code == 200


def test_tls_refuses_plaintext_and_unknown_client_certificates(secure, pki):
    ca, _, clients, stranger = pki
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
        httpx.get(f"http://127.0.0.1:{secure.http_port}/health", timeout=10)
    url = f"https://127.0.0.1:{secure.http_port}/health"
    assert httpx.get(url, verify=_tls(ca.ca_file, clients["team-a"]), timeout=10).status_code \
        == 200
    with pytest.raises(httpx.HTTPError):  # no client certificate: mTLS refuses
        httpx.get(url, verify=_tls(ca.ca_file), timeout=10)
    with pytest.raises(httpx.HTTPError):  # a certificate another CA signed
        httpx.get(url, verify=_tls(ca.ca_file, stranger), timeout=10)
    with pytest.raises(httpx.HTTPError):  # the server's certificate is not one we trust
        httpx.get(url, verify=_tls(None, clients["team-a"]), timeout=10)
    plain = Client(f"127.0.0.1:{secure.grpc_port}", api_key=KEY_A, timeout=10, retry=NO_RETRY)
    with plain, pytest.raises(Unavailable):
        plain.model_info()
    no_cert = Client(f"127.0.0.1:{secure.grpc_port}", api_key=KEY_A, ca_file=ca.ca_file,
                     timeout=10, retry=NO_RETRY)
    with no_cert, pytest.raises(Unavailable):
        no_cert.model_info()


def test_grpc_needs_a_key_and_health_stays_open(secure, pki):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _sdk(secure, pki, None) as c, pytest.raises(Unauthenticated, match="missing API key"):
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    with _sdk(secure, pki, "sk-wrong-wrong-wrong-wrong") as c, pytest.raises(Unauthenticated):
        c.model_info()
    with _sdk(secure, pki, KEY_A) as c:
        out = c.generate(prompt_token_ids=PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 5
    ca, _, clients, _ = pki

    async def with_async_client(key):
        async with AsyncClient(f"127.0.0.1:{secure.grpc_port}", api_key=key, ca_file=ca.ca_file,
                               client_cert=clients["team-b"].cert,
                               client_key=clients["team-b"].key, timeout=60,
                               retry=NO_RETRY) as ac:
            return (await ac.generate(prompt_token_ids=PROMPT, max_tokens=3,
                                      ignore_eos=True)).token_ids
    assert len(asyncio.run(with_async_client(KEY_B))) == 3
    with pytest.raises(Unauthenticated):
        asyncio.run(with_async_client(None))
    with grpc.secure_channel(f"127.0.0.1:{secure.grpc_port}", _creds(pki, "team-b")) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_tenant_never_reaches_another_tenants_request(secure, pki):
    """team-a runs a resumable stream under an id of its choosing. team-b, with the same id:
    Abort finds nothing, Resume and the HTTP resume get NOT_FOUND / 404, and a request of its
    own under that id is served as its own. team-a's stream goes on unharmed and can be
    resumed by team-a."""
    with _sdk(secure, pki, KEY_A) as a:
        alone = a.generate(prompt_token_ids=PROMPT, max_tokens=40, temperature=0,
                           ignore_eos=True).token_ids
        with a.stream(prompt_token_ids=PROMPT, max_tokens=40, temperature=0, ignore_eos=True,
                      request_id="shared-id", resume=True) as s:
            got = list(next(iter(s)).token_ids)
            with _sdk(secure, pki, KEY_B, "team-b") as b:
                assert b.abort("shared-id") is False
                with pytest.raises(NotFound):
                    list(b.resume("shared-id"))
                with _http(secure, pki, KEY_B, "team-b") as h:
                    r = h.get("/v1/streams/shared-id")
                    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
                mine = b.generate(prompt_token_ids=[9, 8, 7], max_tokens=6, temperature=0,
                                  ignore_eos=True, request_id="shared-id")
                assert mine.request_id == "shared-id" and len(mine.token_ids) == 6
            for chunk in s:
                got += chunk.token_ids
        assert s.request_id == "shared-id"
        assert got == alone
        assert [t for ch in a.resume("shared-id") for t in ch.token_ids] == alone


def test_limits_per_key_and_on_size(secure, pki, engine):
    """A third concurrent generation of one key gets 429 / RESOURCE_EXHAUSTED while the other
    key is still served; a body over --max-request-bytes gets 413 (declared or chunked); an
    oversized gRPC message RESOURCE_EXHAUSTED."""
    with _sdk(secure, pki, KEY_A) as a, _sdk(secure, pki, KEY_B, "team-b") as b:
        streams = [a.stream(prompt_token_ids=PROMPT, max_tokens=500, ignore_eos=True)
                   for _ in range(2)]
        try:
            for s in streams:
                next(iter(s))  # both are running
            with pytest.raises(ResourceExhausted, match="2 requests running"):
                a.generate(prompt_token_ids=PROMPT, max_tokens=2)
            with _http(secure, pki, KEY_A) as h:
                r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            # ignore_eos: these sample at the default temperature, and a sampled EOS would end
            # the generation early (seen once in CI: one token, finish_reason "stop").
            assert len(b.generate(prompt_token_ids=PROMPT, max_tokens=3,
                                  ignore_eos=True).token_ids) == 3
        finally:
            for s in streams:
                s.close()
        deadline = time.monotonic() + 20  # the closed streams give their places back
        while True:
            try:
                assert len(a.generate(prompt_token_ids=PROMPT, max_tokens=2,
                                      ignore_eos=True).token_ids) == 2
                break
            except ResourceExhausted:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            a.generate(prompt_token_ids=list(range(3, 3 + MAX_REQUEST_BYTES)), max_tokens=2)

    big = {"prompt": "x" * (MAX_REQUEST_BYTES + 1), "max_tokens": 1}
    with _http(secure, pki, KEY_A) as h:
        r = h.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
                yield b" " * 1024
        r = h.post("/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_rate_limit_answers_429_with_retry_after(engine, server_loop, tmp_path):
    config = SecurityConfig(_keys_file(tmp_path), rate_limit=0.5)  # one request per 2 s
    fd = server_loop.run(serve_frontdoor(engine, grpc_port=0, http_port=0, drain_grace_s=1,
                                         gate=Gate.from_config(config)))
    try:
        def post(key):
            return httpx.post(f"http://127.0.0.1:{fd.http_port}/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 1},
                              headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert post(KEY_A).status_code == 200
        limited = post(KEY_A)
        assert limited.status_code == 429 and limited.headers["retry-after"] in ("1", "2")
        assert post(KEY_B).status_code == 200  # per key
        with Client(f"127.0.0.1:{fd.grpc_port}", api_key=KEY_B, timeout=10, retry=NO_RETRY) as c, \
                pytest.raises(ResourceExhausted, match="rate limit"):
            c.generate(prompt_token_ids=PROMPT, max_tokens=1)
    finally:
        server_loop.run(fd.stop(1))


def test_only_admin_tenants_may_drain_a_worker(engine, server_loop, tmp_path):
    """An operator's call (POST /v1/cluster/workers/{id}/drain) needs a key of a tenant in
    --admin-tenants: no key 401, another tenant's 403 (code "forbidden"), an admin's passes
    the gate (here: 404 worker_not_found, an embedded backend has no workers to drain); a
    bad body is a 400 naming the field. A bad tenant name in the setting is refused."""
    config = SecurityConfig(_keys_file(tmp_path), admin_tenants=("team-b",))
    fd = server_loop.run(serve_frontdoor(engine, grpc_port=0, http_port=0, drain_grace_s=1,
                                         gate=Gate.from_config(config)))
    try:
        def drain(key, body=None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"http://127.0.0.1:{fd.http_port}/v1/cluster/workers/decode-0/drain",
                              json=body, headers=headers, timeout=30)
        assert drain(None).status_code == 401
        forbidden = drain(KEY_A)
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["code"] == "forbidden"
        missing = drain(KEY_B, {"migrate_after_s": 5})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "worker_not_found"
        bad = drain(KEY_B, {"migrate_after_s": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "migrate_after_s"
    finally:
        server_loop.run(fd.stop(1))
    with pytest.raises(ValueError, match="--admin-tenants"):
        SecurityConfig(admin_tenants=("team a",))


def test_undecodable_grpc_bytes_are_invalid_argument(secure, pki):
    """Truncated or garbage protobuf bytes on a raw channel: INVALID_ARGUMENT naming the
    message type, never INTERNAL; the server serves the next request."""
    good = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                              sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
    md = (("authorization", f"Bearer {KEY_A}"),)
    with grpc.secure_channel(f"127.0.0.1:{secure.grpc_port}", _creds(pki, "team-a")) as ch:
        raw = ch.unary_stream("/pdcluster.v1.Generation/Generate",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for bad in (good[:-3], b"\xff\xff\xff\xff\xff", b"\x0a\x80"):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(bad, metadata=md, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
            assert "pdcluster.v1.GenerateRequest" in e.value.details()
        assert len(list(raw(good, metadata=md, timeout=30))) >= 2  # tokens, then complete
        stub = pb_grpc.GenerationStub(ch)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10).vocab_size


def test_bad_key_files_are_refused_naming_the_line(tmp_path):
    def load(text):
        path = tmp_path / "keys"
        path.write_text(text)
        return Gate.from_config(SecurityConfig(str(path)))

    with pytest.raises(ValueError, match="line 2: a key must be at least 16"):
        load(f"{KEY_A}\nshort\n")
    with pytest.raises(ValueError, match="line 2: this key is listed twice"):
        load(f"a:{KEY_A}\nb:{KEY_A}\n")
    with pytest.raises(ValueError, match=r"line 1: tenant name 'a/b'"):
        load(f"a/b:{KEY_A}\n")
    with pytest.raises(ValueError, match="no keys in the file"):
        load("# nothing\n\n")
    gate = load(f"{KEY_A}\n")
    tenant = gate.authenticate(f"Bearer {KEY_A}")
    assert tenant.name.startswith("key-") and gate.scoped(tenant, "x") == f"{tenant.name}/x"


def test_gate_token_bucket_and_concurrency_with_a_fake_clock():
    from router.frontdoor.security import RateLimitedError, Tenant

    now = [0.0]
    gate = Gate(SecurityConfig(rate_limit=2.0, max_concurrent_per_key=3), {},
                clock=lambda: now[0])
    t = Tenant("t", "t/")
    permits = [gate.admit(t), gate.admit(t)]  # the burst: 2
    with pytest.raises(RateLimitedError) as e:
        gate.admit(t)
    assert e.value.retry_after_s == pytest.approx(0.5)
    now[0] += 0.5
    permits.append(gate.admit(t))
    now[0] += 10
    with pytest.raises(RateLimitedError, match="3 requests running"):
        gate.admit(t)  # tokens are there, places are not
    permits[0].release()
    permits[0].release()  # idempotent: frees one place only
    assert gate.running(t) == 2
    permits.append(gate.admit(t))
    assert gate.running(t) == 3
    for p in permits:
        p.release()
    assert gate.running(t) == 0



def test_fuzzed_raw_http_bodies_never_get_a_5xx(secure, pki):
    """Hypothesis throws raw bodies at /v1/completions and /v1/chat/completions over HTTPS with
    a key: truncated and garbage JSON, odd unicode, wrong content types, bodies over the size
    limit. Every answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and a good
    request right after each is served."""
    import json

    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    good = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    bodies = st.one_of(
        st.binary(max_size=300),
        st.text(max_size=200).map(str.encode),  # odd unicode, surrogates excluded by utf-8
        st.integers(1, len(good) - 1).map(lambda n: good[:n]),  # truncated
        st.builds(lambda s: json.dumps({"prompt": s, "max_tokens": 1}).encode(),
                  st.text(alphabet=st.characters(min_codepoint=0x80), max_size=50)),
        st.just(b"[" * 5000 + b"]" * 5000), st.just(b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES
                                                     + b'"}'))
    seen: dict[int, int] = {}
    with _http(secure, pki, KEY_A) as h:
        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
               ctype=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
        @example(body=b'{"prompt": [5, 6', path="/v1/completions", ctype="application/json")
        @example(body=good, path="/v1/completions", ctype="application/json")
        def one(body, path, ctype):
            headers = {"content-type": ctype} if ctype else {}
            r = h.post(path, content=body, headers=headers)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body[:100], r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"], r.text
            assert h.post("/v1/completions", content=good,
                          headers={"content-type": "application/json"}).status_code == 200

        one()
    assert seen.get(200) and seen.get(400), seen


def test_fuzzed_raw_grpc_bytes_never_get_internal(secure, pki):
    """Random bytes as a GenerateRequest on a raw TLS channel: OK (they happened to decode
    into a valid request) or INVALID_ARGUMENT, never INTERNAL; the server goes on serving."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    md = (("authorization", f"Bearer {KEY_A}"),)
    good = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                              sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
    seen: dict[str, int] = {}
    with grpc.secure_channel(f"127.0.0.1:{secure.grpc_port}", _creds(pki, "team-a")) as ch:
        raw = ch.unary_stream("/pdcluster.v1.Generation/Generate",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)

        @settings(max_examples=16, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(st.one_of(st.binary(max_size=200),
                         st.integers(1, len(good) - 1).map(lambda n: good[:n])))
        @example(good)
        @example(b"\x12\x02\xff\xfe")  # field 2 (text) with invalid UTF-8
        def one(data):
            try:
                list(raw(data, metadata=md, timeout=60))
                seen["OK"] = seen.get("OK", 0) + 1
            except grpc.RpcError as e:
                seen[e.code().name] = seen.get(e.code().name, 0) + 1
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, e.details())

        one()
        assert len(list(raw(good, metadata=md, timeout=30))) >= 2
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT"), seen
