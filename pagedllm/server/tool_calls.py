"""Tool calling: the wire shapes and the grammar that enforces a named or required ``tool_choice``
(the parsers of free text, ``--tool-call-parser``, are in tool_parsers.py).

A named or required choice is enforced with a JSON-schema grammar instead, so the output is plain
JSON (the named function's arguments, or a list of ``{"name", "parameters"}``), as vLLM does.
"""

from __future__ import annotations

import json
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
        args = arguments_text(json.loads(text))
        return [ToolCall(function=FunctionCall(name=choice.function.name, arguments=args))]
    return [ToolCall(function=FunctionCall(name=c["name"], arguments=arguments_text(c["parameters"])))
            for c in json.loads(text)]


def arguments_text(value: Any) -> str:
    """A call's arguments as the API sends them: JSON text."""
    return json.dumps(value, ensure_ascii=False)
