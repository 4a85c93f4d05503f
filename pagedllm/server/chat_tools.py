"""How one chat request uses tools: what the template renders, which grammar forces a call, and
how the output becomes ``tool_calls`` (whole, or as streamed deltas)."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

from pagedllm.server.tool_calls import (
    DeltaFunctionCall, DeltaToolCall, ToolCall, ToolChoice, forced_tool_calls, tool_choice_grammar,
)
from pagedllm.server.tool_parsers import ToolParser
from pagedllm.structured import StructuredOutputsParams

log = logging.getLogger("pagedllm.server")


@dataclass
class ToolPlan:
    tools: list[dict] | None  # what the chat template renders (None: no tools offered)
    choice: ToolChoice
    structured: StructuredOutputsParams | None  # the grammar a named/required choice imposes
    parser: ToolParser | None  # parses "auto" outputs

    @classmethod
    def from_request(cls, body, parser: ToolParser | None) -> "ToolPlan":
        """ValueError naming the field for an impossible combination."""
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if not body.tools:
            if choice != "none":
                raise ValueError(f"tool_choice {choice!r} needs tools")
            return cls(None, "none", None, None)
        if choice == "none":
            return cls(None, "none", None, None)
        if choice == "auto" and parser is None:
            raise ValueError("tool_choice 'auto' needs the server started with --tool-call-parser (e.g. hermes)")
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        return cls(tools, choice, tool_choice_grammar(body.tools, choice), parser if choice == "auto" else None)

    @property
    def forced(self) -> bool:
        return self.structured is not None

    def template_tools(self, template: str | None) -> list[dict] | None:
        """The tools the chat template renders. A forced call (named or required) needs no template support,
        as in vLLM: its grammar holds the function's arguments schema; a template that cannot render tools
        then renders the conversation alone."""
        if self.forced and not renders(template, "tools"):
            _note_unrendered_tools()
            return None
        return self.tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output; text a forced call's grammar did not shape (cut
        by a stop string) stays content."""
        if self.forced:
            try:
                return None, forced_tool_calls(text, self.choice)
            except (ValueError, KeyError, TypeError):
                return text, []
        if self.parser is not None:
            return self.parser.extract(text)
        return text, []

    def streamer(self) -> "PlanStreamer":
        return PlanStreamer(self)


class PlanStreamer:
    """Deltas of one streamed choice: forced calls are sent whole when the output ends; "auto"
    outputs go through the parser's streamer."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.inner = plan.parser.stream() if plan.parser is not None else None
        self.forced_sent = 0

    @property
    def calls_sent(self) -> int:
        return self.inner.calls_sent if self.inner is not None else self.forced_sent

    def advance(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.inner is not None:
            return self.inner.advance(text, finished)
        if not finished:
            return "", []
        _, calls = self.plan.parse(text)
        self.forced_sent = len(calls)
        return "", [DeltaToolCall(index=i, id=c.id, type="function",
                                  function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                    for i, c in enumerate(calls)]


def template_messages(messages) -> list[dict]:
    """Chat messages as the template reads them: "developer" is "system"; tool-call arguments are
    objects (as templates expect), not JSON text."""
    out = []
    for m in messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _loads(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _loads(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise ValueError(f"messages: tool_calls arguments must be JSON text: {e}") from e


@functools.cache
def _note_unrendered_tools() -> None:
    log.info("tool_choice forces a call on a chat template that does not render tools: the model sees the "
             "conversation only, the arguments schema holds its output (as vLLM); logged once")


def renders(template: str | None, name: str) -> bool:
    """Whether a Jinja chat template reads the variable ``name`` at all."""
    return name in (template or "")


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, chat_template: str | None,
                template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
    """Prompt ids for the conversation under ``chat_template`` (default: the model's), tools included.

    ``template_kwargs`` (vLLM's add_generation_prompt, continue_final_message, documents,
    chat_template_kwargs) go to the template; the text is then tokenized with ``add_special_tokens``, as
    vLLM does. A template that never reads ``tools`` or ``documents`` would drop them silently, so that is
    an error.
    """
    template = chat_template or tokenizer.chat_template
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    for name, given in (("tools", tools), ("documents", kwargs.get("documents"))):
        if given and not renders(template, name):
            hint = " (e.g. pagedllm/server/chat_templates/hermes_tools.jinja)" if name == "tools" else ""
            raise ValueError(f"{name}: this model's chat template does not render {name}; start the server with "
                             f"a --chat-template that does{hint}")
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
