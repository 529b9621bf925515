"""The HTTP front door's gate keeper, an ASGI middleware in front of every route: the API key
(``Authorization: Bearer KEY``, 401 in OpenAI's error shape without a valid one; ``/health``
always open, ``/metrics`` open when ``Gate.metrics_public``) and the request body's size (413
past ``max_request_bytes``, counted as it arrives, so a chunked body without Content-Length
is cut off too). The caller's tenant goes to ``request.state.tenant`` for the routes.
"""

from __future__ import annotations

import json

from router.frontdoor.errors import map_error, openai_error_body
from router.frontdoor.security import ANONYMOUS, Gate, RequestTooLargeError, UnauthenticatedError

__all__ = ["GuardMiddleware"]

_OPEN_PATHS = ("/health",)


class GuardMiddleware:
    def __init__(self, app, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        open_path = path in _OPEN_PATHS or (path == "/metrics" and self.gate.metrics_public)
        tenant = ANONYMOUS  # open paths serve no tenant's data
        if not open_path:
            try:
                tenant = self.gate.authenticate(headers.get("authorization"))
            except UnauthenticatedError as e:
                await _reply(send, e, {"www-authenticate": "Bearer"})
                return
        limit = self.gate.config.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _reply(send, _too_large(limit))
            return
        body, more = bytearray(), True
        while more:  # read the body here, counting: FastAPI reads it whole anyway
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                await _reply(send, _too_large(limit))
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later: disconnects, which the responder watches for

        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, replay, send)


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"request body is larger than {limit} bytes "
                                f"(--max-request-bytes)")


async def _reply(send, exc: BaseException, extra: dict[str, str] | None = None) -> None:
    err = map_error(exc)
    body = json.dumps(openai_error_body(err)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": err.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
