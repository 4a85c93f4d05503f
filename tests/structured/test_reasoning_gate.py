"""A grammar that waits for the reasoning to end (vLLM's rule under --reasoning-parser): the row is free while
the model writes ``<think>...``, constrained from the token after ``</think>`` (even when the marker comes in
pieces over several tokens), and constrained from the start when the prompt already closed the reasoning."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.structured.reasoning_gate import reasoning_closed

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MARKERS = ("<think>", "</think>")


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed(manager: StructuredOutputManager, seq_id: int, vocab: int) -> torch.Tensor:
    """Which tokens the step's mask leaves for ``seq_id`` (all of them when its row is free)."""
    logits = torch.zeros(1, vocab)
    manager.mask(logits, [seq_id])
    return logits[0] > float("-inf")


def test_grammar_opens_after_the_reasoning_ends(manager, tokenizer):
    vocab = len(tokenizer)
    manager.add(1, StructuredOutputsParams(json=SCHEMA, reasoning=MARKERS), tokenizer.encode("Question?"))
    manager.add(2, StructuredOutputsParams(json=SCHEMA), tokenizer.encode("Question?"))  # no reasoning: at once
    assert bool(allowed(manager, 1, vocab).all()) and not bool(allowed(manager, 2, vocab).all())
    reasoning = tokenizer.encode("Let me see: a is 3.</think>", add_special_tokens=False)
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1  # the marker spans several tokens
    for tok in reasoning[:-1]:
        assert manager.accept([1], [tok]) == []
        assert bool(allowed(manager, 1, vocab).all())  # still reasoning: free
    manager.accept([1], [reasoning[-1]])
    assert not bool(allowed(manager, 1, vocab).all())  # the grammar applies now, from its start
    for tok in tokenizer.encode('{"a": 3}', add_special_tokens=False):
        assert bool(allowed(manager, 1, vocab)[tok]) and manager.accept([1], [tok]) == []
    assert manager.states[1].is_completed()
    manager.free(1)
    manager.free(2)
    assert not manager.states and not manager.gates


def test_forked_sample_keeps_its_own_gate(manager, tokenizer):
    vocab = len(tokenizer)
    manager.add(1, StructuredOutputsParams(json=SCHEMA, reasoning=MARKERS), [])
    manager.accept([1], tokenizer.encode("ok</", add_special_tokens=False)[:1])
    manager.fork(1, 2)
    for tok in tokenizer.encode("</think>", add_special_tokens=False):
        manager.accept([2], [tok])
    assert bool(allowed(manager, 1, vocab).all()) and not bool(allowed(manager, 2, vocab).all())


def test_a_prompt_that_closed_the_reasoning_starts_constrained(manager, tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>short</think>")
    manager.add(1, StructuredOutputsParams(json=SCHEMA, reasoning=MARKERS), prompt)
    assert 1 in manager.states and not bool(allowed(manager, 1, len(tokenizer)).all())


@pytest.mark.parametrize("text, closed", [
    ("<think>a</think>", True), ("<think>a</think> then <think>b", False), ("plain", False), ("x</think>", True),
])
def test_reasoning_closed(text, closed):
    assert reasoning_closed(text, MARKERS) is closed


def test_bad_markers_are_named():
    with pytest.raises(ValueError, match="structured_outputs.reasoning"):
        StructuredOutputsParams(json=json.dumps(SCHEMA), reasoning=("<think>", ""))
