"""pdcluster's gRPC client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio)."""

from client.sdk import AsyncClient, AsyncGenerateStream, Client, GenerateStream
from client.types import (
    Cancelled,
    DeadlineExceeded,
    GenerateResult,
    Internal,
    InvalidArgument,
    ModelInfo,
    NotFound,
    PdclusterError,
    ResourceExhausted,
    RetryPolicy,
    ServedModel,
    StreamChunk,
    TokenLogprob,
    ToolCall,
    Unauthenticated,
    Unavailable,
    Usage,
)

__all__ = [
    "AsyncClient", "AsyncGenerateStream", "Cancelled", "Client", "DeadlineExceeded",
    "GenerateResult", "GenerateStream", "Internal", "InvalidArgument", "ModelInfo", "NotFound",
    "PdclusterError", "ResourceExhausted", "RetryPolicy", "ServedModel", "StreamChunk",
    "TokenLogprob", "ToolCall", "Unauthenticated", "Unavailable", "Usage",
]
