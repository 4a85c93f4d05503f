"""Structured outputs after a reasoning part (vLLM's rule under ``--reasoning-parser``): while the model is
still reasoning (``<think>...``) its tokens are free; the grammar applies from the token that closes the
reasoning (``</think>``) on. A prompt that already closed it (an assistant prefill, a template that switched
thinking off) starts constrained."""

from __future__ import annotations

from pagedllm.structured.state import GrammarState

TAIL_CHARS = 64  # text kept to find an end marker that arrives split over several tokens
PROMPT_TAIL_TOKENS = 64  # where a prompt closes its reasoning: at its end (a prefill, a template's empty think)


def reasoning_closed(text: str, markers: tuple[str, str]) -> bool:
    """True when ``text``'s last end marker comes after its last start marker."""
    start, end = markers
    last_end = text.rfind(end)
    return last_end >= 0 and last_end > text.rfind(start)


class ReasoningGate:
    """One sequence's grammar held back until its reasoning ends; ``feed`` each sampled token's text."""

    def __init__(self, state: GrammarState, markers: tuple[str, str]):
        self.state = state
        self.markers = markers
        self.tail = ""

    def feed(self, text: str) -> bool:
        """Add a token's text; True once the end marker has been written (the grammar applies from now)."""
        self.tail = (self.tail + text)[-TAIL_CHARS:]
        return self.markers[1] in self.tail

    def fork(self) -> ReasoningGate:
        child = ReasoningGate(self.state.fork(), self.markers)
        child.tail = self.tail
        return child
