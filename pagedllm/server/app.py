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
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config.version import __version__
from pagedllm.frontend.async_engine import AsyncEngine
from pagedllm.frontend.core_client import EngineCoreDied
from pagedllm.protocol.outputs import RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.server.chat_tools import ToolPlan, render_chat, template_messages
from pagedllm.server.errors import APIError
from pagedllm.server.echo_logprobs import prompt_completion_logprobs
from pagedllm.server.core_supervisor import (
    CoreDownMiddleware, CoreSupervisor, core_died_error, core_died_info, supervised_lifespan,
)
from pagedllm.server.input_bounds import InputBounds, prompt_chars
from pagedllm.server.inert_fields import mark_ignored
from pagedllm.server.guards import (
    APIKeyMiddleware, HostCheckMiddleware, SizeLimitMiddleware, bad_text_field, error_response,
)
from pagedllm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.server.prompt_logprobs import vllm_prompt_logprobs
from pagedllm.server.reasoning import get_reasoning_parser, reply_parser
from pagedllm.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, Delta, DeltaMessage, DeltaTracker, ErrorInfo, ErrorResponse, ModelCard, ModelList,
    PromptTokensDetails, SamplingRequest, TopLogprob, Usage,
)
from pagedllm.server.request_extras import check_unknown_fields
from pagedllm.server.responses_api import ResponsesServing
from pagedllm.server.responses_api import router as responses_router
from pagedllm.server.routes_lora import lora_model_cards, resolve_model, router as lora_router
from pagedllm.server.routes_utility import router as utility_router
from pagedllm.server.tenants import request_tenant, tenant_cache_salt
from pagedllm.server.stats_logger import DEFAULT_INTERVAL_S, stats_lifespan
from pagedllm.server.tool_parsers import get_tool_parser
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.admission import GrammarAdmission

log = logging.getLogger("pagedllm.server")

DISCONNECT_POLL_S = 0.5  # how often a request checks that its client is still there (aborted within 1 s)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 allow_unknown_fields: bool = False, tool_call_parser: str | None = None,
                 chat_template: str | None = None, return_tokens_as_token_ids: bool = False, max_logprobs: int = 20,
                 log_requests: bool = False, reasoning_parser: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.allow_unknown_fields = allow_unknown_fields
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.chat_template = chat_template
        self.grammars = GrammarAdmission(self.tokenizer, engine.limits.vocab_size, list(engine.spec.eos_token_ids))
        self.bounds = InputBounds(self.tokenizer, engine.max_model_len)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.max_logprobs = max_logprobs  # vLLM's --max-logprobs
        self.log_requests = log_requests  # vLLM's --enable-log-requests
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

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

        if body.priority != 0 and self.engine.args.scheduling_policy != "priority":
            raise APIError(400, f"priority {body.priority} needs the server started with --scheduling-policy "
                           "priority", param="priority")
        if body.prompt_logprobs is not None:
            if body.stream:
                raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
            if prompt_logprobs is not None and prompt_logprobs != body.prompt_logprobs:
                raise APIError(400, f"prompt_logprobs ({body.prompt_logprobs}) must equal logprobs ({prompt_logprobs}) "
                               "with echo", param="prompt_logprobs")
            prompt_logprobs = body.prompt_logprobs

        def run(eng: AsyncEngine) -> tuple[list[list[int]], SamplingParams]:
            extras = body.extra_sampling_kwargs(eng.limits.vocab_size)
            if structured is not None:
                if extras["structured_outputs"] is not None:
                    raise ValueError("tool_choice forces a tool call, which conflicts with response_format "
                                     "and the structured-output fields")
                extras["structured_outputs"] = structured
            if extras["structured_outputs"] is not None:  # checked and compiled before any tokenizing
                extras["structured_outputs"] = self.grammars.admit(extras["structured_outputs"])
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
            for name in ("logprobs", "prompt_logprobs"):
                if (getattr(params, name) or 0) > self.max_logprobs:
                    raise ValueError(f"{name} {getattr(params, name)} is over this server's --max-logprobs "
                                     f"({self.max_logprobs})")
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
                  body: SamplingRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run each prompt as its own engine request; yield (prompt index, cumulative output) as they come.
        ``body`` gives the cache salt (nested in the caller's tenant's), priority and ``model`` (the base
        model's name or a served LoRA adapter's); a client's own request_id may repeat, so the engine's ids
        then get a unique suffix.

        Leaving early (the client went away, or the consumer was cancelled) cancels the pumps, and each
        pump's ``AsyncEngine.generate`` aborts its request, freeing the blocks.
        """
        q: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            last = None
            try:
                async for out in self.engine.generate(ids, params, f"{engine_id}-{i}", salt, body.priority, lora):
                    now = time.monotonic()
                    if last is not None:
                        self.metrics.observe_inter_token(now - last)
                    last = now
                    if out.finished:
                        self.metrics.observe_finished(out)
                    q.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer
                q.put_nowait((i, e))

        if self.log_requests:
            log.info("request %s: %s prompt tokens, %s", request_id, [len(p) for p in prompts], params)
        engine_id = request_id if body.request_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
        salt = tenant_cache_salt(request_tenant(request), body.cache_salt)  # tenants never share a prefix
        lora = resolve_model(self, body.model)  # the base model (None) or the adapter the model name serves
        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        unfinished = len(tasks)
        # the client is checked on a clock, not only when nothing comes (steady news would hide it): a tick joins
        # the queue every DISCONNECT_POLL_S, so an output costs a plain get, not a timed wait (a task and a timer)
        loop = asyncio.get_running_loop()
        tick = loop.call_later(DISCONNECT_POLL_S, q.put_nowait, (-1, None))
        try:
            while unfinished:
                i, item = await q.get()
                if item is None:
                    if await request.is_disconnected():
                        raise APIError(499, "client closed the request", type="client_closed_request")
                    tick = loop.call_later(DISCONNECT_POLL_S, q.put_nowait, (-1, None))
                    continue
                if isinstance(item, Exception):
                    raise item
                unfinished -= item.finished
                yield i, item
        finally:
            tick.cancel()
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

    def logprob_token_namer(self, body: SamplingRequest) -> Callable[[int], str]:
        """How logprobs name a token: its text, or vLLM's "token_id:N" under return_tokens_as_token_ids (the
        request's field, else the server's flag)."""
        as_ids = body.return_tokens_as_token_ids
        if as_ids if as_ids is not None else self.return_tokens_as_token_ids:
            return lambda tid: f"token_id:{tid}"
        return self.token_text

    @staticmethod
    def completion_logprobs(d: Delta, offset: int, name: Callable[[int], str]) -> CompletionLogprobs:
        """OpenAI completions shape; ``offset`` is where the first new token starts in the choice's text."""
        lp = CompletionLogprobs()
        for tid, entry in zip(d.token_ids, d.logprobs or []):
            tok = name(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry[tid])
            lp.top_logprobs.append({name(t): v for t, v in entry.items()})
            lp.text_offset.append(offset)
            offset += len(tok)
        return lp

    @staticmethod
    def chat_logprobs(d: Delta, top_n: int, name: Callable[[int], str]) -> ChatLogprobs:
        def top(tid: int, logprob: float) -> dict:
            tok = name(tid)
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
        self.bounds.check(prompt_chars(prompts), "prompt")
        if body.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {body.max_tokens}", param="max_tokens")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 is only meaningful with echo (to score the prompt)", param="max_tokens")
        # echo + logprobs scores the prompt too (lm-eval's loglikelihood); max_tokens 0 generates one token
        # and drops it
        scores_prompt = body.echo and body.logprobs is not None

        def tokenize(eng: AsyncEngine) -> list[list[int]]:
            return [eng.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) and not
                    body.add_special_tokens else eng.tokenize(p)[1] for p in prompts]

        ids, params = await self.admit(body, tokenize, max(body.max_tokens, 1), body.logprobs,
                                       prompt_logprobs=body.logprobs if scores_prompt else None)
        if body.echo:
            echo = [p if isinstance(p, str) and not scores_prompt else "".join(map(self.token_text, ids[i]))
                    for i, p in enumerate(prompts)]
        else:
            echo = None
        rid, created, n = f"cmpl-{body.request_id or uuid.uuid4().hex}", int(time.time()), params.n
        name = self.logprob_token_namer(body)
        offsets: dict[int, int] = {}  # per choice: characters emitted so far (for text_offset)

        def choice(i: int, d: Delta, index: int, out: RequestOutput) -> CompletionChoice:
            if body.max_tokens == 0:
                d = Delta("", [], [], d.finish_reason and "length", None)
            prefix = echo[i] if echo is not None and index not in offsets else ""
            start = offsets.get(index, len(prefix))
            lp = self.completion_logprobs(d, start, name) if params.logprobs is not None else None
            offsets[index] = start + sum(map(len, lp.tokens)) if lp else start
            if prefix and lp is not None:  # the prompt's logprobs come first, as the echoed text does
                head = prompt_completion_logprobs(ids[i], self.prompt_logprobs(out), self.token_text)
                lp = CompletionLogprobs(**{k: getattr(head, k) + getattr(lp, k)
                                           for k in CompletionLogprobs.model_fields})
            return CompletionChoice(index=index, text=prefix + d.text, logprobs=lp, finish_reason=d.finish_reason,
                                    stop_reason=d.stop_reason, prompt_logprobs=self.vllm_prompt_logprobs(body, out))

        def response(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        if not body.stream:
            finals = {i: out async for i, out in self.run(request, ids, params, rid, body) if out.finished}
            choices = [choice(i, Delta.whole(o), i * n + o.index, finals[i]) for i in sorted(finals)
                       for o in finals[i].outputs]
            return JSONResponse(response(choices, self.usage(ids, finals, body.max_tokens > 0)).model_dump())

        async def chunks() -> AsyncIterator[BaseModel]:
            trackers: dict[int, DeltaTracker] = {}
            latest: dict[int, RequestOutput] = {}
            async for i, out in self.run(request, ids, params, rid, body):
                latest[i] = out
                choices = []
                for o in out.outputs:
                    index = i * n + o.index
                    d = trackers.setdefault(index, DeltaTracker(params.stop)).advance(o)
                    if d is not None and (d.text or d.token_ids or d.finish_reason):
                        choices.append(choice(i, d, index, out))
                if choices:
                    yield response(choices, self.usage(ids, latest, body.max_tokens > 0)
                                   if body.continuous_usage else None)
            if body.include_usage:
                yield response([], self.usage(ids, latest, body.max_tokens > 0))

        return self.sse(chunks())

    def vllm_prompt_logprobs(self, body: SamplingRequest, out: RequestOutput) -> list | None:
        """vLLM's ``prompt_logprobs`` field when the request asked for it, else None (left out)."""
        if body.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.prompt_logprobs(out), body.prompt_logprobs, self.logprob_token_namer(body))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_text(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            plan = ToolPlan.from_request(body, self.tool_parser)
            messages = template_messages(body.messages)
            template_kwargs = body.template_kwargs()
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from e
        self.bounds.check(sum(len(m["content"]) for m in messages), "messages")
        top_n = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids, params = await self.admit(
            body, lambda eng: [render_chat(eng.tokenizer, messages,
                                           plan.template_tools(self.chat_template or eng.tokenizer.chat_template),
                                           self.chat_template, template_kwargs, body.add_special_tokens)],
            max_tokens, top_n if body.logprobs else None, structured=plan.structured)
        rid, created = f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
        name = self.logprob_token_namer(body)

        def logprobs(d: Delta) -> ChatLogprobs | None:
            return self.chat_logprobs(d, top_n, name) if body.logprobs else None

        # a constrained output (structured outputs, a forced tool call) applies after the reasoning part
        reasoner = reply_parser(self.reasoning_parser, self.engine.tokenizer, ids[0], params)

        if not body.stream:
            final = None
            async for _, out in self.run(request, ids, params, rid, body):
                final = out
            choices = []
            for o in final.outputs:
                reasoning, text = reasoner.split(o.text) if reasoner else ("", o.text)
                content, calls = plan.parse(text) if o.finish_reason != "length" else (text, [])
                message = ChatResponseMessage(content=content or None if reasoner else content, tool_calls=calls,
                                              reasoning_content=reasoning or None if body.include_reasoning else None)
                choices.append(ChatChoice(index=o.index, message=message,
                                          logprobs=logprobs(Delta.whole(o)), stop_reason=o.stop_reason,
                                          finish_reason="tool_calls" if calls else o.finish_reason))
            resp = ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                          usage=self.usage(ids, {0: final}),
                                          prompt_logprobs=self.vllm_prompt_logprobs(body, final))
            return JSONResponse(resp.model_dump())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        async def chunks() -> AsyncIterator[BaseModel]:
            trackers = [DeltaTracker(params.stop) for _ in range(params.n)]
            streamers = [plan.streamer() for _ in range(params.n)] if plan.tools else None
            reasoners = [reasoner.stream() for _ in range(params.n)] if reasoner else None
            final, role_sent = None, False
            async for _, out in self.run(request, ids, params, rid, body):
                final = out
                usage = self.usage(ids, {0: out}) if body.continuous_usage else None
                if not role_sent and (out.finished or any(o.token_ids for o in out.outputs)):
                    # the role goes out with the first token (as vLLM's), so a client's TTFT is true
                    role_sent = True
                    yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                                 for j in range(params.n)], usage)
                choices = []
                for o in out.outputs:
                    d = trackers[o.index].advance(o)
                    if d is None or not (d.text or d.token_ids or d.finish_reason):
                        continue
                    delta, reason, text = DeltaMessage(content=d.text), d.finish_reason, o.text
                    if reasoners is not None:  # reasoning and content split from the text released so far
                        sent = o.text[:trackers[o.index].text_sent]
                        new_r, new_c = reasoners[o.index].advance(sent, reason is not None)
                        delta = DeltaMessage(content=new_c or None,
                                             reasoning_content=new_r or None if body.include_reasoning else None)
                        text = reasoners[o.index].content(sent, reason is not None)
                    if streamers is not None:  # the (content) text goes through the tool-call parser
                        text, calls = streamers[o.index].advance(text, d.finish_reason is not None)
                        delta = DeltaMessage(content=text or None, reasoning_content=delta.reasoning_content,
                                             tool_calls=calls or None)
                        reason = "tool_calls" if reason and streamers[o.index].calls_sent else reason
                    choices.append(ChatChunkChoice(index=o.index, delta=delta, logprobs=logprobs(d),
                                                   finish_reason=reason))
                if choices:
                    yield chunk(choices, usage)
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
            except EngineCoreDied as e:  # the supervisor restarts the core; the client may retry
                yield f"data: {ErrorResponse(error=core_died_info(e)).model_dump_json()}\n\n"
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
    return mark_ignored(await _serving(request).completions(body, request), body)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return mark_ignored(await _serving(request).chat(body, request), body)


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
               restart_core: bool = True, on_core_lost: Callable[[], None] | None = None,
               api_keys: dict[str, str] | None = None, allowed_origins: list[str] | None = None,
               **serving_options) -> FastAPI:
    """The server app over ``engine``; the model is served under ``served_model_name``.

    ``api_key`` guards every route that shows data (``guards.APIKeyMiddleware``; /metrics also takes
    ``metrics_token`` or is left open by ``metrics_open``), as do ``api_keys`` ({key: tenant}: each
    tenant's prefix cache salted apart, ``tenants``); ``enable_docs`` serves /docs, /redoc and
    /openapi.json (off by default); ``allowed_hosts`` (None: no check) are the Host names accepted;
    ``allowed_origins`` (vLLM's --allowed-origins) turns on CORS for them; ``serving_options``
    (allow_unknown_fields, tool_call_parser, chat_template...) go to ``OpenAIServing``;
    a stats line is logged every ``stats_interval_s`` (None: never). A dead engine core is restarted
    (``restart_core``) or, that off or failing, ``on_core_lost`` runs (``core_supervisor``)."""
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    supervisor = CoreSupervisor(engine, restart=restart_core, on_give_up=on_core_lost)
    app = FastAPI(title="pagedllm", version=__version__,
                  lifespan=supervised_lifespan(stats_lifespan(engine, stats_interval_s), supervisor), **docs)
    app.state.engine = engine
    app.state.supervisor = supervisor
    model_name = served_model_name or engine.model_name
    app.state.metrics = ServerMetrics(model_name)
    app.state.serving = OpenAIServing(engine, model_name, app.state.metrics,
                                      **serving_options)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineCoreDied, core_died_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.state.responses = ResponsesServing()
    app.include_router(router)
    app.include_router(utility_router)
    app.include_router(responses_router)
    app.include_router(lora_router)
    try:
        from pagedllm.server.dashboard import router as dashboard_router
    except ModuleNotFoundError as e:  # the dashboard is optional; anything else wrong in it should surface
        if e.name != "pagedllm.server.dashboard":
            raise
    else:
        app.include_router(dashboard_router)
    if api_key or api_keys:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, metrics_token=metrics_token, metrics_open=metrics_open,
                           tenant_keys=api_keys)
    app.add_middleware(CoreDownMiddleware, engine=engine)
    app.add_middleware(SizeLimitMiddleware)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)  # added last: runs first
    return app
