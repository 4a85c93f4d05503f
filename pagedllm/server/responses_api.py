"""``/v1/responses``, OpenAI's Responses API for text (as vLLM serves it), over the chat path.

A request (``instructions``, ``input`` as text or items: messages, ``function_call``, ``function_call_output``;
function ``tools``; ``text.format`` json_object / json_schema) becomes a chat request; the chat reply becomes
``output`` items (a message with ``output_text``, and ``function_call`` items). Streaming sends the Responses
events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``). A stored response
(``store``, default true) can be continued with ``previous_response_id``: the conversation is kept in memory,
at most ``ResponseStore.max_items`` of them, each for ``ttl_s``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.request_extras import check_unknown_fields


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(_Item):
    """A message (``role`` + ``content``), a ``function_call`` or a ``function_call_output``."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class TextConfig(_Item):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_Item):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None


class ResponseStore:
    """Conversations of stored responses, for ``previous_response_id``: bounded in count and age."""

    def __init__(self, max_items: int = 1000, ttl_s: float = 3600.0):
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict[str, tuple[float, list[dict], dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        with self._lock:
            self._items[response_id] = (time.monotonic(), messages, response)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            got = self._items.get(response_id)
            if got is None:
                return None
            if time.monotonic() - got[0] > self.ttl_s:
                del self._items[response_id]
                return None
            return got[1], got[2]


def _text(content: str | list[ContentPart] | None) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


def chat_messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The chat conversation: instructions, the previous responses' turns, then this input."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    out += history
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if item.type == "message":
            if item.role is None:
                raise ValueError("input: a message item needs a role")
            out.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call":
            if item.name is None or item.arguments is None or item.call_id is None:
                raise ValueError("input: a function_call item needs call_id, name and arguments")
            call = {"name": item.name, "arguments": item.arguments}
            out.append({"role": "assistant", "content": None,
                        "tool_calls": [{"id": item.call_id, "type": "function", "function": call}]})
        else:
            if item.call_id is None or item.output is None:
                raise ValueError("input: a function_call_output item needs call_id and output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_request(body: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
    """The chat request that computes this response; ValueError naming a bad field."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                            "top_p": body.top_p, "stream": stream, "seed": body.seed,
                            "max_completion_tokens": body.max_output_tokens}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(by_alias=True, exclude={"type"},
                                                                        exclude_none=True)} for t in body.tools]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if isinstance(body.tool_choice, dict):  # {"type": "function", "name": ...}
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if not fmt.schema_:
            raise ValueError("text: format json_schema needs a schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


def _usage(u: dict | None) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


class ResponsesServing:
    def __init__(self, store: ResponseStore | None = None):
        self.store = store or ResponseStore()

    def envelope(self, rid: str, body: ResponsesRequest, model: str, created: int, status: str,
                 output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": body.instructions, "previous_response_id": body.previous_response_id,
                "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": body.tool_choice or "auto",
                "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []],
                "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(
                    by_alias=True, exclude_none=True),
                "store": body.store, "metadata": body.metadata or {}, "user": body.user}

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        serving = request.app.state.serving
        history: list[dict] = []
        if body.previous_response_id is not None:
            got = self.store.get(body.previous_response_id)
            if got is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} not found (not stored, or "
                               "expired)", param="previous_response_id", code="previous_response_not_found")
            history = got[0]
        try:
            messages = chat_messages(body, history)
            chat = chat_request(body, messages, body.stream)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from e
        rid, created, model = f"resp_{uuid.uuid4().hex}", int(time.time()), serving.model_name
        reply = await serving.chat(chat, request)
        if not body.stream:
            data = json.loads(reply.body)
            choice = data["choices"][0]
            message = choice["message"]
            output = [_call_item(c) for c in message["tool_calls"]]
            if message["content"] or not output:
                output.insert(0, _message_item(message["content"] or ""))
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            response = self.envelope(rid, body, model, created, status, output, _usage(data["usage"]),
                                     choice["finish_reason"])
            self._keep(body, rid, messages, message, response)
            return JSONResponse(response)
        return StreamingResponse(self._events(body, rid, model, created, messages, reply.body_iterator),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _keep(self, body: ResponsesRequest, rid: str, messages: list[dict], message: dict, response: dict) -> None:
        if body.store:
            turn = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                turn["tool_calls"] = message["tool_calls"]
            self.store.put(rid, [m for m in messages if body.instructions is None or m is not messages[0]] + [turn],
                           response)

    async def _events(self, body: ResponsesRequest, rid: str, model: str, created: int, messages: list[dict],
                      chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The chat stream's chunks as Responses events."""
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        item = _message_item("", "in_progress")
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        yield event("response.created", response=self.envelope(rid, body, model, created, "in_progress", [], None))
        yield event("response.output_item.added", output_index=0, item={**item, "content": []})
        yield event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
        text, calls, usage, finish = "", {}, None, None
        async for raw in chunks:
            for line in raw.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    yield event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"))
                    return
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    delta, finish = c["delta"], c["finish_reason"] or finish
                    if delta.get("content"):
                        text += delta["content"]
                        yield event("response.output_text.delta", **where, delta=delta["content"], logprobs=[])
                    for call in delta.get("tool_calls") or []:  # forced calls arrive whole
                        calls[call["index"]] = {"id": call["id"], "type": "function", "function": call["function"]}
        item = _message_item(text)
        item["id"] = where["item_id"]
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=item["content"][0])
        yield event("response.output_item.done", output_index=0, item=item)
        output = [item]
        for i, call in sorted(calls.items()):
            fc = _call_item(call)
            yield event("response.output_item.added", output_index=len(output), item={**fc, "status": "in_progress"})
            yield event("response.output_item.done", output_index=len(output), item=fc)
            output.append(fc)
        status = "incomplete" if finish == "length" else "completed"
        response = self.envelope(rid, body, model, created, status, output, _usage(usage), finish)
        self._keep(body, rid, messages, {"content": text, "tool_calls": [calls[i] for i in sorted(calls)]}, response)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=response)


router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    try:
        check_unknown_fields(body, request.app.state.serving.allow_unknown_fields)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(": ", 1)[1].split(",")[0]) from e
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict:
    got = request.app.state.responses.store.get(response_id)
    if got is None:
        raise APIError(404, f"response {response_id!r} not found (not stored, or expired)", param="response_id",
                       code="not_found")
    return got[1]
