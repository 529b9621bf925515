"""The one place where typed backend errors become gRPC status codes and HTTP errors.

Both servers call ``map_error``; nothing else decides what a ValueError means on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from router.contract import (
    DeadlineExceededError,
    DeadlineRefusedError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    ResponseNotFoundError,
    StreamNotFoundError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)
from router.frontdoor.security import (
    ForbiddenError,
    RateLimitedError,
    RequestTooLargeError,
    UnauthenticatedError,
)

__all__ = ["MappedError", "map_error", "openai_error_body"]


@dataclass(frozen=True)
class MappedError:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str  # OpenAI's error "type" field
    openai_code: str | None
    message: str
    retry_after_s: float | None = None  # HTTP Retry-After (rate limits)


def map_error(exc: BaseException) -> MappedError:
    """Classify ``exc``: no or a bad API key -> UNAUTHENTICATED/401, a key that may not do
    this (an operator's call) -> PERMISSION_DENIED/403, a body too large ->
    RESOURCE_EXHAUSTED/413, a tenant over its limits -> RESOURCE_EXHAUSTED/429 (Retry-After),
    bad input -> INVALID_ARGUMENT/400, unknown model, stream or worker -> NOT_FOUND/404,
    queue full -> RESOURCE_EXHAUSTED/429, no live worker -> UNAVAILABLE/503, the caller's
    deadline passed mid-flight -> DEADLINE_EXCEEDED/504 (grpc-gateway's mapping), anything
    else -> INTERNAL/500.

    InvalidRequestError is a ValueError, so any ValueError (e.g. from SamplingParams) counts
    as bad input; unexpected errors keep their type name so logs and clients can tell them apart.
    """
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, UnauthenticatedError):
        return MappedError(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error",
                           "invalid_api_key", msg)
    if isinstance(exc, ForbiddenError):
        return MappedError(grpc.StatusCode.PERMISSION_DENIED, 403, "invalid_request_error",
                           "forbidden", msg)
    if isinstance(exc, RequestTooLargeError):
        return MappedError(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error",
                           "request_too_large", msg)
    if isinstance(exc, RateLimitedError):
        return MappedError(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
                           "rate_limit_exceeded", msg, exc.retry_after_s)
    if isinstance(exc, ModelNotFoundError):
        return MappedError(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error",
                           "model_not_found", msg)
    if isinstance(exc, ResponseNotFoundError):
        return MappedError(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error",
                           "response_not_found", msg)
    if isinstance(exc, StreamNotFoundError):
        return MappedError(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error",
                           "stream_not_found", msg)
    if isinstance(exc, WorkerNotFoundError):
        return MappedError(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error",
                           "worker_not_found", msg)
    if isinstance(exc, InvalidRequestError | ValueError):
        return MappedError(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error",
                           None, msg)
    if isinstance(exc, QueueFullError):  # a predicted wait, where known: Retry-After
        return MappedError(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
                           "deadline_unmet" if isinstance(exc, DeadlineRefusedError)
                           else "queue_full", msg, getattr(exc, "retry_after_s", None))
    if isinstance(exc, DeadlineExceededError):
        return MappedError(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error",
                           "deadline_exceeded", msg)
    if isinstance(exc, WorkerUnavailableError):
        return MappedError(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable",
                           "no_worker", msg)
    return MappedError(grpc.StatusCode.INTERNAL, 500, "internal_error", None,
                       f"internal error: {type(exc).__name__}: {msg}")


def openai_error_body(err: MappedError, param: str | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": err.message, "type": err.openai_type, "param": param,
                      "code": err.openai_code}}
