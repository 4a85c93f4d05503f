"""``--reasoning-parser``: a reasoning model's ``<think>...</think>`` goes to the reply's ``reasoning_content``
(vLLM's field), the rest to ``content``, whole or streamed; tool calls are parsed from the content only.

deepseek_r1: the template opens ``<think>`` in the prompt, so the output is reasoning up to ``</think>`` (an
optional leading ``<think>`` is dropped); an output that never closes it is all reasoning. qwen3: reasoning
only when the output opens with ``<think>`` (thinking can be switched off in the template); an output that
opens it and never closes it is all reasoning, one that does not open it is all content.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.structured.reasoning_gate import PROMPT_TAIL_TOKENS, reasoning_closed

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # deepseek_r1: the output starts inside the reasoning

    def split(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(reasoning, content): the two parts of ``text`` so far; before it has finished, a tag that may still
        be forming at the end is held back (in neither part)."""
        body = text
        opened = self.opens_in_prompt
        if text.startswith(START):
            body, opened = text[len(START):], True
        elif not finished and START.startswith(text):  # "<thi..." could still become the opening tag
            return "", ""
        if not opened:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        hold = 0 if finished else _partial_suffix(body, END)
        return body[:len(body) - hold], ""

    def stream(self) -> "ReasoningStreamer":
        return ReasoningStreamer(self)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag still being generated)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamer:
    """One streamed choice: each call returns the new reasoning and the new content since the last."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.reasoning_sent = 0
        self.content_sent = 0

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, finished)
        new_r, new_c = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return new_r, new_c

    def content(self, text: str, finished: bool) -> str:
        """The content part of ``text`` so far (what the tool-call parser reads)."""
        return self.parser.split(text, finished)[1]


def reply_parser(parser: ReasoningParser | None, tokenizer, prompt_ids: list[int],
                 params: SamplingParams) -> ReasoningParser | None:
    """The parser for one reply: None without one, or when the prompt already closed the reasoning (an
    assistant prefill, thinking switched off): all the output is content. A structured output (or a forced
    tool call) is marked to wait in the engine for the reasoning's end, as vLLM's grammar does."""
    if parser is None:
        return None
    if params.structured_outputs is not None:
        params.structured_outputs = replace(params.structured_outputs, reasoning=(START, END))
    return None if reasoning_closed(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]), (START, END)) else parser


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """ValueError naming the known parsers."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose {', '.join(REASONING_PARSERS)}") from None
