"""``--tool-call-parser``: the model's text to ``tool_calls``, whole or streamed, in vLLM's formats.

hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro, Qwen 2.5).
llama3_json: the output is JSON calls ``{"name": ..., "parameters": {...}}`` (after an optional
``<|python_tag|>``), several separated by ``;`` (Llama 3.1-3.3). mistral: ``[TOOL_CALLS]`` and a JSON list of
``{"name", "arguments"}``. pythonic: the output is a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2/4,
ToolACE). qwen3_coder: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``.

Each parser says where calls begin (content is what comes before) and which complete calls the text from
there holds; one streamer serves them all.
"""

from __future__ import annotations

import ast
import json
import re

from pagedllm.server.tool_calls import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, arguments_text


class ToolParser:
    """Base: calls begin at ``MARKER`` anywhere in the text (or, with ``AT_START``, only at its start)."""

    MARKER = ""
    AT_START = False

    def start(self, text: str) -> int:
        """Where the calls begin, or -1."""
        if self.AT_START:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.MARKER) else -1
        return text.find(self.MARKER)

    def pending(self, text: str) -> int:
        """How much of the end of ``text`` might still become the marker (held back while streaming)."""
        if self.AT_START:
            stripped = text.lstrip()
            return len(text) if self.MARKER.startswith(stripped) else 0
        return next((k for k in range(len(self.MARKER) - 1, 0, -1) if text.endswith(self.MARKER[:k])), 0)

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        """The complete calls in ``tail`` (the text from where calls begin); None when it is not calls at all
        (then the whole output is content)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls, the calls) of a finished output; text that is not calls stays content."""
        at = self.start(text)
        calls = self.calls(text[at:], True) if at >= 0 else None
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    def stream(self) -> "ToolCallStreamer":
        return ToolCallStreamer(self)


def _call(name, arguments) -> ToolCall | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(function=FunctionCall(name=name, arguments=arguments_text(arguments)))


def _json_objects(text: str, sep: str) -> tuple[list, bool]:
    """JSON values at the start of ``text``, separated by ``sep`` and whitespace; (values, whether all of the
    text was read)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == len(text):
            return values, True
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return values, False
        values.append(value)


class HermesToolParser(ToolParser):
    MARKER = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        calls = []
        for body in self._BLOCK.findall(tail):
            try:
                obj = json.loads(body)
            except ValueError:
                return None
            call = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
        return calls


class Llama3JsonToolParser(ToolParser):
    MARKER = "{"
    AT_START = True
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG):
            return len(text) - len(stripped)
        return super().start(text)

    def pending(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self.TAG.startswith(stripped) else super().pending(text)

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        values, whole = _json_objects(tail.removeprefix(self.TAG), ";")
        calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) if isinstance(v, dict) else None
                 for v in values]
        if None in calls or (finished and not whole):
            return None
        return calls


class MistralToolParser(ToolParser):
    MARKER = "[TOOL_CALLS]"

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        values, whole = _json_objects(tail[len(self.MARKER):], ",")
        if not values:
            return None if finished else []
        if not isinstance(values[0], list) or (finished and not whole):
            return None
        calls = [_call(v.get("name"), v.get("arguments")) if isinstance(v, dict) else None for v in values[0]]
        return None if None in calls else calls


class PythonicToolParser(ToolParser):
    MARKER = "["
    AT_START = True

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        try:
            tree = ast.parse(tail.strip(), mode="eval").body
        except SyntaxError:
            return None if finished else []  # a list still being written
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                kwargs = {kw.arg: _literal(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            calls.append(_call(node.func.id, kwargs))
        return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    """A Python literal, JSON's true/false/null accepted too (templates write arguments with tojson)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


class Qwen3CoderToolParser(ToolParser):
    MARKER = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def calls(self, tail: str, finished: bool) -> list[ToolCall] | None:
        calls = []
        for name, body in self._BLOCK.findall(tail):
            calls.append(_call(name, {k: _value(v) for k, v in self._PARAM.findall(body)}))
        if finished and not calls:
            return None
        return calls


def _value(text: str):
    """A parameter's value: JSON when it reads as JSON (numbers, objects), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class ToolCallStreamer:
    """Cuts one choice's cumulative text into content deltas and whole tool-call deltas: content is sent up to
    where calls begin (holding back a tail that could begin them); each call goes out once it is complete."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.content_sent = 0
        self.calls_sent = 0

    def advance(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        p = self.parser
        start = p.start(text)
        if finished and start >= 0 and not p.calls(text[start:], True):
            start = -1  # it was not calls after all: all of it is content
        end = len(text) if start < 0 else start
        if start < 0 and not finished:
            end = len(text) - p.pending(text)
        content = text[self.content_sent: end] if end > self.content_sent else ""
        self.content_sent += len(content)
        calls = (p.calls(text[start:], finished) or []) if start >= 0 else []
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls) if i >= self.calls_sent]
        self.calls_sent = max(self.calls_sent, len(calls))
        return content, deltas


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
    "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
