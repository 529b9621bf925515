"""LoRA adapters over HTTP (vLLM's routes): ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` with ``{"lora_name", "lora_path"}``; operators' calls (any caller
when keys are off, else a key of an ``--admin-tenants`` tenant), answered like vLLM's: 200 with
a line of text, or OpenAI's error shape (400 a refused adapter or one in use, 404 an unknown
name)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from router.contract import GenerationBackend, InvalidRequestError
from router.frontdoor.openai.responder import error_response
from router.frontdoor.security import Gate


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    # vLLM's: the adapter's int id, when given checked against the name's (the router assigns
    # ids; a client's id is never used to pick an adapter).
    lora_int_id: int | None = None


def add_adapter_routes(app: FastAPI, backend: GenerationBackend, gate: Gate) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        try:
            gate.authorize_admin(request.state.tenant)
            await backend.load_lora_adapter(body.lora_name, body.lora_path)
        except (ValueError, LookupError, PermissionError) as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        try:
            gate.authorize_admin(request.state.tenant)
            if body.lora_int_id is not None:
                _check_id(backend, body.lora_name, body.lora_int_id)
            await backend.unload_lora_adapter(body.lora_name)
        except (ValueError, LookupError, PermissionError) as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")


def _check_id(backend: GenerationBackend, name: str, lora_int_id: int) -> None:
    served = {m.id: m for m in backend.served_models()}
    if name in served and served[name].int_id not in (None, lora_int_id):
        raise InvalidRequestError(f"lora_int_id {lora_int_id} does not name adapter {name!r} "
                                  f"(its id is {served[name].int_id})")
