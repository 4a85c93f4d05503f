"""The front end's output processor: incremental text, stop strings on new text only, and work per
token that does not grow with the output length (counted in tokens decoded and characters scanned)."""

from __future__ import annotations

import pytest

from pagedllm.protocol.core_io import EngineCoreOutput, SeqDelta
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from pagedllm.models.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


def _feed(proc: OutputProcessor, ids: list[int], rid: str = "r", finish_at_end: bool = True):
    """Deliver ``ids`` one token per step; returns per-step (tokens decoded, chars scanned) and the last output."""
    work, out = [], None
    for i, t in enumerate(ids):
        before = proc.tokens_decoded, proc.chars_scanned
        last = finish_at_end and i == len(ids) - 1
        d = SeqDelta(0, [t], 0.0, finish_reason="length" if last else None)
        outs, _ = proc.process([EngineCoreOutput(rid, [d], finished=last)])
        work.append((proc.tokens_decoded - before[0], proc.chars_scanned - before[1]))
        out = outs[0] if outs else out
    return work, out


def test_work_per_token_is_constant(tokenizer, wiki_texts):
    ids = tokenizer.encode(" ".join(wiki_texts[:40]), add_special_tokens=False)[:3000]
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=4000, stop=["<never-there>", "zzzzzz"]), 0.0)
    work, out = _feed(proc, ids)
    assert all(w[0] == 1 for w in work)  # one token decoded per token, however long the output
    early = max(w[1] for w in work[:200])
    late = max(w[1] for w in work[-200:])
    assert late <= max(early, 13 + 40)  # the stop window: new text + (longest stop - 1) characters
    assert out.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_text_equals_whole_decode_at_every_step(tokenizer):
    text = "Zürich, 東京 and naïve café ☕: done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=100), 0.0)
    for i, t in enumerate(ids):
        outs, _ = proc.process([EngineCoreOutput("r", [SeqDelta(0, [t], 0.0)])])
        whole = tokenizer.decode(ids[: i + 1], skip_special_tokens=True).rstrip("\ufffd")
        got = outs[0].outputs[0].text
        assert whole.startswith(got)  # never ahead, never different
        assert len(whole) - len(got) <= 1  # at most a space held back with an incomplete character


def test_stop_string_across_tokens_truncates_and_reports(tokenizer):
    ids = tokenizer.encode(" alpha beta gamma delta epsilon", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=100, stop=["ma del"]), 0.0)
    stops = []
    for t in ids:
        outs, hit = proc.process([EngineCoreOutput("r", [SeqDelta(0, [t], 0.0)])])
        stops += hit
        if outs and outs[0].finished:
            break
    assert stops == [("r", 0, "ma del")]
    assert outs[0].finished and outs[0].outputs[0].text == " alpha beta gam"
    assert outs[0].outputs[0].stop_reason == "ma del"
