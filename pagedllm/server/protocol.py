"""OpenAI wire shapes (requests strict, so a wrong type is a 400 rather than a silent coercion),
and the conversion of the engine's cumulative outputs into streamable deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.protocol.outputs import CompletionOutput
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.server.inert_fields import InertFields
from pagedllm.server.prompt_logprobs import PromptLogprob
from pagedllm.server.request_extras import SamplingExtras
from pagedllm.server.tool_calls import DeltaToolCall, Tool, ToolCall, ToolChoice


# ----------------------------------------------------------------------------- requests
class _Request(BaseModel):
    # Unknown fields are kept in model_extra and refused by the server (request_extras.check_unknown_fields);
    # known ones are type-checked strictly.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (guidellm always sends it)


class SamplingRequest(SamplingExtras, InertFields, _Request):
    """Fields both endpoints share: OpenAI's plus vLLM's sampling extras and request fields."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # vLLM's request fields
    priority: int = 0  # lower runs first, with --scheduling-policy priority
    request_id: str | None = None  # the response id's suffix (default: random)
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N" (None: the server's flag)
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token, in the response's prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range settings."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM sends usage in every chunk only when both stream options are set."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS/EOS around a text prompt


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, rendered by the chat template
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context limit
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    # vLLM's chat template controls
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    add_special_tokens: bool = False  # the template writes the special tokens itself
    documents: list[dict[str, str]] | None = None  # RAG documents, for templates that render them
    include_reasoning: bool = True  # False: drop reasoning_content (with --reasoning-parser)

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template``; ValueError naming the field for a bad combination."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false: a reply either continues "
                             "the last message or starts a new one")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(extra) & _RENDER_ARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do")
        return {**extra, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "documents": self.documents}


# apply_chat_template's own arguments, which chat_template_kwargs must not override
_RENDER_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


# ----------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    @field_validator("message", "param")
    @classmethod
    def _encodable(cls, v: str | None) -> str | None:
        """Echoed input may hold a lone surrogate, which no JSON encoder can write: escape it."""
        return None if v is None else v.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    """A whole completion, and (with partial choices) one streamed chunk: OpenAI uses one shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------- deltas
@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per new token: {token: logprob}, sampled token first
    finish_reason: str | None
    stop_reason: str | int | None

    @classmethod
    def whole(cls, out: CompletionOutput) -> "Delta":
        """All of a finished choice at once: non-streamed responses share the streamed formatting."""
        return cls(out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason)


class DeltaTracker:
    """Turns one choice's cumulative outputs into deltas whose concatenation is the final text.

    Text that a stop string still being matched could cut off (its length - 1 characters), and a
    trailing partial UTF-8 character (decoded as U+FFFD), are held back until they are settled.
    """

    def __init__(self, stop: list[str]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text_sent = 0
        self.tokens_sent = 0
        self.finished = False

    def advance(self, out: CompletionOutput) -> Delta | None:
        """The news in ``out`` since the last call; None once the choice has finished."""
        if self.finished:
            return None
        self.finished = out.finish_reason is not None
        end = len(out.text)
        if not self.finished:
            end = len(out.text.rstrip("\ufffd")) - self.holdback
        text = out.text[self.text_sent: end] if end > self.text_sent else ""
        self.text_sent += len(text)
        new_ids = out.token_ids[self.tokens_sent:]
        logprobs = out.logprobs[self.tokens_sent: len(out.token_ids)] if out.logprobs is not None else None
        self.tokens_sent = len(out.token_ids)
        return Delta(text, new_ids, logprobs, out.finish_reason, out.stop_reason)
