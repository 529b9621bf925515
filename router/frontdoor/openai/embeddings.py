"""``POST /v1/embeddings`` (OpenAI's): ``input`` a string, a list of strings, token ids or a list
of them; ``encoding_format`` float or base64 (little-endian float32, base64: what OpenAI's
client asks for and decodes); ``dimensions`` refused (no served model can shorten its vectors:
refused, not ignored); ``model`` the base model or a LoRA adapter. Each input counts as one
generation against its tenant's limits. How the hidden states are pooled is the server's
setting (``pdcluster serve --pooling``)."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from router.contract import EmbedInput, GenerationBackend, InvalidRequestError
from router.frontdoor.openai.responder import error_response
from router.frontdoor.security import Gate

_TokenId = Annotated[int, Field(ge=0)]
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[_TokenId], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: (_Text | Annotated[list[_Text], Field(min_length=1, max_length=2048)] | _Ids
            | Annotated[list[_Ids], Field(min_length=1, max_length=2048)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [list(x)]
        return list(x)


def add_embedding_routes(app: FastAPI, backend: GenerationBackend, gate: Gate,
                         request_id) -> None:
    """``request_id(request)``: the id a call runs under (``x-request-id`` or a new one)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        tenant = request.state.tenant
        if body.dimensions is not None:
            return error_response(InvalidRequestError(
                f"dimensions: {backend.model_info().model_id}'s embeddings cannot be "
                "shortened (refused, not ignored)"), "dimensions")
        permits = []
        try:
            inputs = body.inputs()
            for _ in inputs:
                permits.append(gate.admit(tenant))
            out = await backend.embed(EmbedInput(inputs, body.model,
                                                 gate.scoped(tenant, request_id(request)),
                                                 body.user))
        except Exception as e:  # mapped once (router.frontdoor.errors): 400 / 404 / 429 / 503
            return error_response(e)
        finally:
            for p in permits:
                p.release()
        return {"object": "list", "model": body.model or backend.model_info().model_id,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(out.embeddings)],
                "usage": {"prompt_tokens": out.prompt_tokens,
                          "total_tokens": out.prompt_tokens}}


def _encode(v: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return v
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
