"""Tool calling: the wire shapes, the grammar that enforces a named or required ``tool_choice``,
and the parsers (``--tool-call-parser``) that turn the model's text into ``tool_calls``.

The Hermes/Qwen format puts each call in ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
A named or required choice is enforced with a JSON-schema grammar instead, so the output is plain
JSON (the named function's arguments, or a list of ``{"name", "parameters"}``), as vLLM does.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.structured import StructuredOutputsParams


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Wire):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Wire):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_choice_grammar(tools: list[Tool], choice: ToolChoice | None) -> StructuredOutputsParams | None:
    """The JSON schema that forces a named or required tool call; None for auto/none."""
    if isinstance(choice, NamedToolChoice):
        fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if fn is None:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return StructuredOutputsParams(json=fn.parameters)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    return None


def forced_tool_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The tool calls of an output generated under a named or required choice's grammar."""
    if isinstance(choice, NamedToolChoice):
        return [ToolCall(function=FunctionCall(name=choice.function.name, arguments=_args(json.loads(text))))]
    return [ToolCall(function=FunctionCall(name=c["name"], arguments=_args(c["parameters"])))
            for c in json.loads(text)]


def _args(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Hermes 2 Pro, Qwen 2.5/3)."""

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call, the calls); a block that is not a JSON call stays content."""
        calls = []
        for body in self._BLOCK.findall(text):
            call = self._call(body)
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.START)].strip()
        return content or None, calls

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return ToolCall(function=FunctionCall(name=obj["name"], arguments=_args(obj.get("arguments", {}))))

    def stream(self) -> "ToolCallStreamer":
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Cuts one choice's cumulative text into content deltas and whole tool-call deltas.

    Content is sent up to the first ``<tool_call>`` (holding back a tail that could begin one);
    each call is sent as one delta when its block closes.
    """

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.content_sent = 0
        self.calls_sent = 0

    def advance(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        start = text.find(self.parser.START)
        end = len(text) if start < 0 else start
        if start < 0 and not finished:  # keep back a suffix that may be the start of "<tool_call>"
            end = len(text) - next((k for k in range(len(self.parser.START) - 1, 0, -1)
                                    if text.endswith(self.parser.START[:k])), 0)
        content = text[self.content_sent: end] if end > self.content_sent else ""
        self.content_sent += len(content)
        _, calls = self.parser.extract(text) if start >= 0 else (None, [])
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls) if i >= self.calls_sent]
        self.calls_sent = max(self.calls_sent, len(calls))
        return content, deltas


TOOL_PARSERS = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
