"""LoRA adapters over HTTP (vLLM's routes): a request picks an adapter by its OpenAI ``model`` name, /v1/models
lists them under the base model, and /v1/load_lora_adapter and /v1/unload_lora_adapter change them at runtime
(behind the API key, like every route that is not open). A bad adapter is refused with the reason; the adapters
already served and the requests running are untouched."""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.lora.pager import unload_adapter
from pagedllm.lora.registry import LoRARegistry
from pagedllm.protocol.lora_request import LoRARequest
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ModelCard

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def resolve_model(serving, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model); 404 naming an unknown name."""
    if model is None or model == serving.model_name:
        return None
    loras = serving.engine.loras
    lora = None if loras is None else loras.get(model)
    if lora is None:
        raise APIError(404, f"model {model!r} does not exist; this server serves {serving.model_name!r}"
                       + ("" if loras is None else " and its LoRA adapters (GET /v1/models)"),
                       param="model", code="model_not_found")
    return lora


def lora_model_cards(serving) -> list[ModelCard]:
    """One card per served adapter, after the base model's."""
    loras = serving.engine.loras
    if loras is None:
        return []
    return [ModelCard(id=name, max_model_len=serving.engine.max_model_len) for name in sorted(loras.by_name)]


def _registry(request: Request) -> LoRARegistry:
    loras = request.app.state.engine.loras
    if loras is None:
        raise APIError(400, "LoRA adapters are off: start the server with --enable-lora", code="lora_disabled")
    return loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> PlainTextResponse:
    loras = _registry(request)
    if body.lora_name == request.app.state.serving.model_name:
        raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
    except ValueError as e:  # a taken name or an adapter that cannot serve: the reason, nothing else changes
        raise APIError(400, str(e), param="lora_name" if "already loaded" in str(e) else "lora_path",
                       code="invalid_lora") from e
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> PlainTextResponse:
    """New requests can no longer name the adapter; its pages go back to the pool at once unless running
    requests use it (they finish with it; it is then the first evicted). Ids are never reused, so no cached KV
    of it is ever matched again."""
    loras = _registry(request)
    try:
        lora = loras.remove(body.lora_name)
    except KeyError:
        raise APIError(404, f"LoRA adapter {body.lora_name!r} is not loaded", param="lora_name",
                       code="model_not_found") from None
    await request.app.state.engine.call(functools.partial(unload_adapter, lora.lora_int_id))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
