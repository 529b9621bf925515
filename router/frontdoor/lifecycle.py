"""Start the gRPC and HTTP front doors on ONE asyncio loop over one backend, and drain them.

``serve_frontdoor`` binds both servers (port 0: pick a free one; the bound ports are reported)
and returns a ``FrontDoor``. ``FrontDoor.stop(grace_s)`` drains: health turns NOT_SERVING / 503,
both servers stop accepting, in-flight requests get up to ``grace_s`` to finish, and whatever is
still running is then cancelled (which aborts it in the backend, freeing its KV). The front door
does not own the backend: the caller shuts it down after ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl

import uvicorn

from engine.core.grammar import preload as preload_grammars
from router.contract import GenerationBackend
from router.frontdoor.grpc_server import GrpcServer, start_grpc_server
from router.frontdoor.http_app import create_app
from router.frontdoor.metrics import Metrics
from router.frontdoor.security import Gate

__all__ = ["FrontDoor", "install_signal_handlers", "serve_frontdoor"]

log = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM belongs to ``install_signal_handlers``,
    which drains both servers together."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class FrontDoor:
    """Both servers, running. Create with ``serve_frontdoor``."""

    def __init__(self, backend: GenerationBackend, metrics: Metrics, grpc_server: GrpcServer,
                 http_server: _EmbeddedUvicorn, http_task: asyncio.Task, http_port: int,
                 app, drain_grace_s: float) -> None:
        self.backend = backend
        self.metrics = metrics
        self.app = app
        self.drain_grace_s = drain_grace_s
        self._grpc = grpc_server
        self._http = http_server
        self._http_task = http_task
        self._http_port = http_port
        self._closed = asyncio.Event()
        self._stopping: asyncio.Task | None = None

    @property
    def grpc_port(self) -> int:
        return self._grpc.port

    @property
    def http_port(self) -> int:
        return self._http_port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop both servers; in-flight requests get ``grace_s`` seconds (default:
        ``drain_grace_s``) before they are cancelled. Idempotent; concurrent calls share one
        drain, except that ``grace_s=0`` during a drain cuts it short."""
        grace = self.drain_grace_s if grace_s is None else grace_s
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._drain(grace))
        elif grace == 0 and not self._stopping.done():
            # Second SIGTERM / impatient caller: cancel in-flight requests now.
            self._http.force_exit = True
            await self._grpc.server.stop(0)
        await asyncio.shield(self._stopping)

    async def _drain(self, grace_s: float) -> None:
        log.info("front door draining (grace %.1f s)", grace_s)
        self.app.state.draining = True
        self._http.config.timeout_graceful_shutdown = grace_s
        self._http.should_exit = True
        try:
            await asyncio.gather(self._grpc.stop(grace_s), self._http_task)
        finally:
            self._closed.set()
            log.info("front door stopped")

    async def wait_closed(self) -> None:
        """Return once ``stop`` has finished (or the HTTP server died on its own)."""
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait({closed, self._http_task}, return_when=asyncio.FIRST_COMPLETED)
            if self._stopping is None and not closed.done():
                # uvicorn exited without stop() (it failed): take gRPC down with it, now.
                await self.stop(0)
            # During a drain uvicorn may finish first; gRPC streams still get their grace.
            await closed
        finally:
            closed.cancel()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"could not bind the HTTP server to {host}:{port}: {e}") from e
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_frontdoor(backend: GenerationBackend, host: str = "127.0.0.1",
                          grpc_port: int = 50051, http_port: int = 8000,
                          drain_grace_s: float = 30.0, gate: Gate | None = None,
                          tool_call_parser: str | None = None,
                          reasoning_parser: str | None = None,
                          response_store=None) -> FrontDoor:
    """Start gRPC (``grpc_port``) and OpenAI-compatible HTTP (``http_port``) on the running loop.

    Port 0 picks a free port; read the bound ones from ``.grpc_port`` / ``.http_port``. Both
    servers feed one ``Metrics`` (served at ``/metrics``) and sit behind one ``gate`` (API
    keys, tenants, limits, TLS for both: router/frontdoor/security.py); ``tool_call_parser``
    overrides the tool-call format read off the model's chat template; ``reasoning_parser``
    (router.frontdoor.openai.reasoning) splits chat output into reasoning and content (HTTP
    chat and gRPC chat-messages prompts);
    ``response_store``: where stored Responses-API responses go (the cluster's store; None:
    this process). Raises RuntimeError if a port
    cannot be bound, ValueError for unreadable TLS files (nothing is left running then).
    """
    gate = gate or Gate()
    # Requests with a grammar are validated on this loop: their library is imported up front.
    await asyncio.get_running_loop().run_in_executor(None, preload_grammars)
    metrics = Metrics(backend)
    grpc_server = await start_grpc_server(backend, metrics, host, grpc_port, gate,
                                         tool_call_parser, reasoning_parser)
    try:
        sock = _bind(host, http_port)
    except BaseException:
        await grpc_server.stop(0)
        raise
    app = create_app(backend, metrics, gate, tool_call_parser, reasoning_parser, response_store)
    tls = gate.config.tls
    ssl_args = {} if tls is None else dict(
        ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file, ssl_ca_certs=tls.client_ca_file,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca_file else ssl.CERT_NONE)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_grace_s, **ssl_args)
    http_server = _EmbeddedUvicorn(config)
    http_task = asyncio.ensure_future(http_server.serve(sockets=[sock]))
    while not http_server.started and not http_task.done():
        await asyncio.sleep(0.005)
    if http_task.done():
        await grpc_server.stop(0)
        sock.close()
        http_task.result()  # re-raise uvicorn's startup error
        raise RuntimeError("the HTTP server exited during startup")
    bound_port = sock.getsockname()[1]
    log.info("front door serving gRPC on %s:%d and HTTP%s on %s:%d (API keys: %s)", host,
             grpc_server.port, "S" if tls else "", host, bound_port,
             "required" if gate.auth_required else "off")
    return FrontDoor(backend, metrics, grpc_server, http_server, http_task, bound_port, app,
                     drain_grace_s)


def install_signal_handlers(frontdoor: FrontDoor,
                            signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
                            ) -> None:
    """On SIGTERM/SIGINT, drain the front door (``frontdoor.drain_grace_s``); a second signal
    stops at once. Call from the loop's thread; then ``await frontdoor.wait_closed()``."""
    loop = asyncio.get_running_loop()
    received = [0]

    def on_signal(sig: signal.Signals) -> None:
        received[0] += 1
        grace = frontdoor.drain_grace_s if received[0] == 1 else 0.0
        log.warning("%s received: %s", sig.name,
                    "draining" if received[0] == 1 else "stopping now")
        task = loop.create_task(frontdoor.stop(grace))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
