"""vLLM's utility endpoints: /tokenize, /detokenize, /version, /ping, /v1/models/{id}."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.config.version import __version__
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ModelCard

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None  # chat messages, rendered with the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def _serving(request: Request):
    return request.app.state.serving


def _error(status: int, message: str, **kw) -> Exception:
    return APIError(status, message, **kw)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    from pagedllm.server.chat_tools import render_chat

    s = _serving(request)
    s.check_text(body)
    if (body.prompt is None) == (body.messages is None):
        raise _error(400, "send exactly one of prompt and messages", param="prompt")
    if body.model is not None and body.model != s.model_name:
        raise _error(400, f"model {body.model!r} is not served here", param="model", code="model_not_found")
    if body.prompt is not None:  # refused by its length before tokenizing; tokenized off the event loop
        s.bounds.check(len(body.prompt), "prompt")
        ids = await asyncio.to_thread(s.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        s.bounds.check(sum(len(str(m.get("content", ""))) for m in body.messages), "messages")
        try:
            ids = await asyncio.to_thread(render_chat, s.tokenizer, body.messages, None, s.chat_template)
        except Exception as e:  # noqa: BLE001 - a template error is the client's message's fault
            raise _error(400, f"messages cannot be rendered: {e}", param="messages") from e
    return {"tokens": ids, "count": len(ids), "max_model_len": s.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    s = _serving(request)
    vocab = s.engine.limits.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise _error(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return {"prompt": s.tokenizer.decode(body.tokens)}


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/ping")
async def ping(request: Request) -> dict:
    if request.app.state.engine.error is not None:
        raise _error(503, "engine failed", type="server_error")
    return {"status": "ok"}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    s = _serving(request)
    if model_id != s.model_name:
        raise _error(404, f"model {model_id!r} is not served here; this server serves {s.model_name!r}",
                       param="model", code="model_not_found")
    return ModelCard(id=s.model_name, max_model_len=s.engine.max_model_len)
