"""OpenAI-compatible HTTP server over one shared ``AsyncEngine``.

Every request is tokenized and validated on the engine thread before anything is scheduled, so
a bad request is a single 400 and never half-runs. Outputs stream from the engine as cumulative
``RequestOutput``s; deltas are cut from the cumulative text (see ``DeltaTracker``) so streamed
text always equals non-streamed text. A client that goes away aborts its requests, which frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config.version import __version__
from pagedllm.frontend.async_engine import AsyncEngine
from pagedllm.protocol.outputs import RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.server.chat_tools import ToolPlan, render_chat, template_messages
from pagedllm.server.errors import APIError
from pagedllm.server.echo_logprobs import prompt_completion_logprobs
from pagedllm.server.guards import (
    APIKeyMiddleware, HostCheckMiddleware, SizeLimitMiddleware, bad_text_field, error_response,
)
from pagedllm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, Delta, DeltaMessage, DeltaTracker, ErrorInfo, ErrorResponse, ModelCard, ModelList,
    PromptTokensDetails, SamplingRequest, TopLogprob, Usage,
)
from pagedllm.server.request_extras import check_unknown_fields
from pagedllm.server.routes_lora import lora_model_cards, resolve_model, router as lora_router
from pagedllm.server.routes_utility import router as utility_router
from pagedllm.server.stats_logger import DEFAULT_INTERVAL_S, stats_lifespan
from pagedllm.server.tool_calls import get_tool_parser
from pagedllm.structured import GrammarCompiler, StructuredOutputsParams

log = logging.getLogger("pagedllm.server")

DISCONNECT_POLL_S = 0.5  # how often a request checks that its client is still there (aborted within 1 s)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 allow_unknown_fields: bool = False, tool_call_parser: str | None = None,
                 chat_template: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.allow_unknown_fields = allow_unknown_fields
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.chat_template = chat_template
        self.grammars = GrammarCompiler(self.tokenizer, engine.limits.vocab_size, list(engine.spec.eos_token_ids))

    # ------------------------------------------------------------------ admission
    @staticmethod
    def check_text(body: BaseModel) -> None:
        """400 naming the first field whose text is not valid UTF-8 (a lone surrogate from a JSON escape)."""
        where = bad_text_field(body)
        if where is not None:
            raise APIError(400, f"{where}: text must be valid UTF-8 (no lone surrogates)", param=where.split(".")[0]
                           .split("[")[0], code="invalid_text")

    def check_model(self, body: SamplingRequest) -> None:
        """404 naming a ``model`` that is neither the base model nor a served LoRA adapter."""
        resolve_model(self, body.model)

    async def admit(self, body: SamplingRequest, tokenize: Callable[[AsyncEngine], list[list[int]]],
                    max_tokens: int | None, logprobs: int | None, structured: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None) -> tuple[list[list[int]], SamplingParams]:
        """Tokenize and validate every prompt here, in the front end (off the event loop); ``max_tokens=None``
        means as many as fit.

        ``structured`` (a forced tool call's grammar) stands in for the request's own constraint."""
        try:
            check_unknown_fields(body, self.allow_unknown_fields)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(": ", 1)[1].split(",")[0]) from e

        def run(eng: AsyncEngine) -> tuple[list[list[int]], SamplingParams]:
            extras = body.extra_sampling_kwargs(eng.limits.vocab_size)
            if structured is not None:
                if extras["structured_outputs"] is not None:
                    raise ValueError("tool_choice forces a tool call, which conflicts with response_format "
                                     "and the structured-output fields")
                extras["structured_outputs"] = structured
            ids = tokenize(eng)
            if body.truncate_prompt_tokens is not None:
                ids = [p[-body.truncate_prompt_tokens:] for p in ids]
            limit = max_tokens
            if limit is None:  # the most the context and (for all n samples) the pool can take
                longest = max(map(len, ids))
                lim = eng.limits
                per_sample = (lim.num_blocks * lim.block_size - longest) // max(body.n, 1) - lim.block_size
                limit = max(1, min(eng.max_model_len - longest, per_sample))
            params = dataclasses.replace(body.sampling_params(limit, logprobs), prompt_logprobs=prompt_logprobs,
                                         **extras)
            if params.structured_outputs is not None:
                self.grammars.compile(params.structured_outputs)
            for prompt_ids in ids:
                eng.validate(prompt_ids, params)
            if max_tokens is not None and max(map(len, ids)) + max_tokens > eng.max_model_len:
                raise ValueError(f"max_tokens ({max_tokens}) plus the prompt ({max(map(len, ids))} tokens) "
                                 f"exceeds the context limit (max_model_len {eng.max_model_len})")
            return ids, params

        self.check_model(body)
        try:
            return await asyncio.to_thread(run, self.engine)
        except ValueError as e:
            word = str(e).split(" ", 1)[0].split(".")[0].rstrip(":")
            raise APIError(400, str(e), param=word if word in type(body).model_fields else None) from e

    # ------------------------------------------------------------------ running
    async def run(self, request: Request, prompts: list[list[int]], params: SamplingParams, request_id: str,
                  cache_salt: str | None, model: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run each prompt as its own engine request; yield (prompt index, cumulative output) as they come.

        ``model``: the base model's name or a served LoRA adapter's. Leaving early (the client went away, or
        the consumer was cancelled) cancels the pumps, and each pump's ``AsyncEngine.generate`` aborts its
        request, freeing the blocks.
        """
        q: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        lora = resolve_model(self, model)

        async def pump(i: int, ids: list[int]) -> None:
            last = None
            try:
                async for out in self.engine.generate(ids, params, f"{request_id}-{i}", cache_salt, lora):
                    now = time.monotonic()
                    if last is not None:
                        self.metrics.observe_inter_token(now - last)
                    last = now
                    if out.finished:
                        self.metrics.observe_finished(out)
                    q.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        unfinished = len(tasks)
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            while unfinished:
                try:  # the client is checked on a clock, not only when nothing comes (steady news would hide it)
                    i, item = await asyncio.wait_for(q.get(), max(next_poll - time.monotonic(), 0.0))
                except TimeoutError:
                    item = None
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise APIError(499, "client closed the request", type="client_closed_request")
                if item is None:
                    continue
                if isinstance(item, Exception):
                    raise item
                unfinished -= item.finished
                yield i, item
        finally:
            if unfinished:
                self.metrics.aborted.inc(unfinished)
            for t in tasks:
                t.cancel()

    @staticmethod
    def usage(prompts: list[list[int]], finals: dict[int, RequestOutput], generated: bool = True) -> Usage:
        """``generated=False``: the sampled tokens were dropped (completions with max_tokens 0)."""
        prompt = sum(map(len, prompts))
        completion = sum(len(o.token_ids) for out in finals.values() for o in out.outputs) if generated else 0
        cached = sum(out.num_cached_tokens for out in finals.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    # ------------------------------------------------------------------ logprobs
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, d: Delta, offset: int) -> CompletionLogprobs:
        """OpenAI completions shape; ``offset`` is where the first new token starts in the choice's text."""
        lp = CompletionLogprobs()
        for tid, entry in zip(d.token_ids, d.logprobs or []):
            tok = self.token_text(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry[tid])
            lp.top_logprobs.append({self.token_text(t): v for t, v in entry.items()})
            lp.text_offset.append(offset)
            offset += len(tok)
        return lp

    def chat_logprobs(self, d: Delta, top_n: int) -> ChatLogprobs:
        def top(tid: int, logprob: float) -> dict:
            tok = self.token_text(tid)
            return {"token": tok, "logprob": logprob, "bytes": list(tok.encode())}

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(tid, entry[tid]), top_logprobs=[
                TopLogprob(**top(t, v)) for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]])
            for tid, entry in zip(d.token_ids, d.logprobs or [])])

    @staticmethod
    def prompt_logprobs(out: RequestOutput) -> list[dict[int, float] | None]:
        got = getattr(out, "prompt_logprobs", None)
        if got is None:
            raise RuntimeError("the engine returned no prompt logprobs (SamplingParams.prompt_logprobs)")
        return got

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_text(body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        if body.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {body.max_tokens}", param="max_tokens")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 is only meaningful with echo (to score the prompt)", param="max_tokens")
        # echo + logprobs scores the prompt too (lm-eval's loglikelihood); max_tokens 0 generates one token
        # and drops it
        scores_prompt = body.echo and body.logprobs is not None
        ids, params = await self.admit(body, lambda eng: [eng.tokenize(p)[1] for p in prompts],
                                       max(body.max_tokens, 1), body.logprobs,
                                       prompt_logprobs=body.logprobs if scores_prompt else None)
        if body.echo:
            echo = [p if isinstance(p, str) and not scores_prompt else "".join(map(self.token_text, ids[i]))
                    for i, p in enumerate(prompts)]
        else:
            echo = None
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), params.n
        offsets: dict[int, int] = {}  # per choice: characters emitted so far (for text_offset)

        def choice(i: int, d: Delta, index: int, out: RequestOutput) -> CompletionChoice:
            if body.max_tokens == 0:
                d = Delta("", [], [], d.finish_reason and "length", None)
            prefix = echo[i] if echo is not None and index not in offsets else ""
            start = offsets.get(index, len(prefix))
            lp = self.completion_logprobs(d, start) if params.logprobs is not None else None
            offsets[index] = start + sum(map(len, lp.tokens)) if lp else start
            if prefix and lp is not None:  # the prompt's logprobs come first, as the echoed text does
                head = prompt_completion_logprobs(ids[i], self.prompt_logprobs(out), self.token_text)
                lp = CompletionLogprobs(**{k: getattr(head, k) + getattr(lp, k)
                                           for k in CompletionLogprobs.model_fields})
            return CompletionChoice(index=index, text=prefix + d.text, logprobs=lp, finish_reason=d.finish_reason,
                                    stop_reason=d.stop_reason)

        def response(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        if not body.stream:
            finals = {i: out async for i, out in self.run(request, ids, params, rid, body.cache_salt, body.model)
                      if out.finished}
            choices = [choice(i, Delta.whole(o), i * n + o.index, finals[i]) for i in sorted(finals)
                       for o in finals[i].outputs]
            return JSONResponse(response(choices, self.usage(ids, finals, body.max_tokens > 0)).model_dump())

        async def chunks() -> AsyncIterator[BaseModel]:
            trackers: dict[int, DeltaTracker] = {}
            finals: dict[int, RequestOutput] = {}
            async for i, out in self.run(request, ids, params, rid, body.cache_salt, body.model):
                if out.finished:
                    finals[i] = out
                choices = []
                for o in out.outputs:
                    index = i * n + o.index
                    d = trackers.setdefault(index, DeltaTracker(params.stop)).advance(o)
                    if d is not None and (d.text or d.token_ids or d.finish_reason):
                        choices.append(choice(i, d, index, out))
                if choices:
                    yield response(choices)
            if body.include_usage:
                yield response([], self.usage(ids, finals, body.max_tokens > 0))

        return self.sse(chunks())

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_text(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            plan = ToolPlan.from_request(body, self.tool_parser)
            messages = template_messages(body.messages)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from e
        top_n = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids, params = await self.admit(
            body, lambda eng: [render_chat(eng.tokenizer, messages, plan.tools, self.chat_template)], max_tokens,
            top_n if body.logprobs else None, structured=plan.structured)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(d: Delta) -> ChatLogprobs | None:
            return self.chat_logprobs(d, top_n) if body.logprobs else None

        if not body.stream:
            final = None
            async for _, out in self.run(request, ids, params, rid, body.cache_salt, body.model):
                final = out
            choices = []
            for o in final.outputs:
                content, calls = plan.parse(o.text) if o.finish_reason != "length" else (o.text, [])
                choices.append(ChatChoice(index=o.index, message=ChatResponseMessage(content=content, tool_calls=calls),
                                          logprobs=logprobs(Delta.whole(o)), stop_reason=o.stop_reason,
                                          finish_reason="tool_calls" if calls else o.finish_reason))
            resp = ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                          usage=self.usage(ids, {0: final}))
            return JSONResponse(resp.model_dump())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        async def chunks() -> AsyncIterator[BaseModel]:
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                         for j in range(params.n)])
            trackers = [DeltaTracker(params.stop) for _ in range(params.n)]
            streamers = [plan.streamer() for _ in range(params.n)] if plan.tools else None
            final = None
            async for _, out in self.run(request, ids, params, rid, body.cache_salt, body.model):
                final = out
                choices = []
                for o in out.outputs:
                    d = trackers[o.index].advance(o)
                    if d is None or not (d.text or d.token_ids or d.finish_reason):
                        continue
                    delta, reason = DeltaMessage(content=d.text), d.finish_reason
                    if streamers is not None:  # the text goes through the tool-call parser
                        text, calls = streamers[o.index].advance(o.text, d.finish_reason is not None)
                        delta = DeltaMessage(content=text or None, tool_calls=calls or None)
                        reason = "tool_calls" if reason and streamers[o.index].calls_sent else reason
                    choices.append(ChatChunkChoice(index=o.index, delta=delta, logprobs=logprobs(d),
                                                   finish_reason=reason))
                if choices:
                    yield chunk(choices)
            if body.include_usage:
                yield chunk([], self.usage(ids, {0: final}))

        return self.sse(chunks())

    @staticmethod
    def sse(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
        """Server-sent events: one ``data:`` line per chunk, then ``[DONE]``. Any failure after the status
        line was sent ends the stream with an error event and then ``[DONE]``, never a cut connection;
        the details go to the log, not to the client."""

        async def body() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    yield f"data: {c.model_dump_json()}\n\n"
            except APIError as e:
                if e.status == 499:  # the client went away: nobody to tell
                    return
                yield f"data: {ErrorResponse(error=e.info).model_dump_json()}\n\n"
            except Exception:  # noqa: BLE001 - reported to the client as an event, logged in full
                log.exception("stream failed")
                info = ErrorInfo(message="the server failed while generating this response", type="server_error")
                yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------------- routes
router = APIRouter()


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _serving(request).completions(body, request)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _serving(request).chat(body, request)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    s = _serving(request)
    return ModelList(data=[ModelCard(id=s.model_name, max_model_len=s.engine.max_model_len), *lora_model_cards(s)])


@router.get("/health")
async def health(request: Request) -> dict:
    """503 once the engine loop has failed; with ``check_integrity`` on, also verifies the KV pool."""
    engine: AsyncEngine = request.app.state.engine
    if engine.error is not None:
        raise APIError(503, "the engine has failed; restart the server", type="server_error")
    if engine.args.check_integrity:
        try:
            await engine.check_integrity()
        except AssertionError as e:  # the details (block ids, hashes) go to the log only
            log.error("KV pool integrity check failed: %s", e)
            raise APIError(503, "KV pool integrity check failed", type="server_error") from e
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    snapshot = await request.app.state.engine.stats()
    return Response(request.app.state.metrics.render(snapshot), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------- errors
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.info)


async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    """Pydantic's 422 becomes OpenAI's 400, naming the first offending field."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return error_response(400, ErrorInfo(message=f"malformed JSON body: {err.get('msg')}", code="invalid_json"))
    where = ".".join(loc)
    return error_response(400, ErrorInfo(message=f"{where}: {err.get('msg')}" if where else str(err.get("msg")),
                                         param=loc[0] if loc else None))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    message = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
    return error_response(e.status_code, ErrorInfo(message=message, code="not_found" if e.status_code == 404 else None))


async def _server_error(request: Request, e: Exception) -> JSONResponse:
    """A 500 (503 once the engine has failed) that names no internals; the details go to the log."""
    log.error("unhandled error", exc_info=e)
    if request.app.state.engine.error is not None:
        return error_response(503, ErrorInfo(message="the engine has failed; restart the server", type="server_error"))
    return error_response(500, ErrorInfo(message="internal server error", type="server_error"))


def create_app(engine: AsyncEngine, api_key: str | None = None, served_model_name: str | None = None,
               stats_interval_s: float | None = DEFAULT_INTERVAL_S, metrics_token: str | None = None,
               metrics_open: bool = False, enable_docs: bool = False, allowed_hosts: list[str] | None = None,
               **serving_options) -> FastAPI:
    """The server app over ``engine``; the model is served under ``served_model_name``.

    ``api_key`` guards every route that shows data (``guards.APIKeyMiddleware``; /metrics also takes
    ``metrics_token`` or is left open by ``metrics_open``); ``enable_docs`` serves /docs, /redoc and
    /openapi.json (off by default); ``allowed_hosts`` (None: no check) are the Host names accepted;
    ``serving_options`` (allow_unknown_fields, tool_call_parser, chat_template) go to ``OpenAIServing``;
    a stats line is logged every ``stats_interval_s`` (None: never)."""
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedllm", version=__version__, lifespan=stats_lifespan(engine, stats_interval_s), **docs)
    app.state.engine = engine
    model_name = served_model_name or engine.model_name
    app.state.metrics = ServerMetrics(model_name)
    app.state.serving = OpenAIServing(engine, model_name, app.state.metrics,
                                      **serving_options)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(router)
    app.include_router(utility_router)
    app.include_router(lora_router)
    try:
        from pagedllm.server.dashboard import router as dashboard_router
    except ModuleNotFoundError as e:  # the dashboard is optional; anything else wrong in it should surface
        if e.name != "pagedllm.server.dashboard":
            raise
    else:
        app.include_router(dashboard_router)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, metrics_token=metrics_token, metrics_open=metrics_open)
    app.add_middleware(SizeLimitMiddleware)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)  # added last: runs first
    return app
