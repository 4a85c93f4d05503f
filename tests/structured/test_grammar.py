"""Grammar-constrained sampling from random logits: every output matches its spec.

The loop is the one the engine runs per step: fill one bitmask row per structured sequence,
mask the batch's logits in place, sample, and advance each sequence's state by its token.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm.structured import StructuredOutputsParams, allocate_bitmask, apply_bitmask

# twenty varied schemas; strings and arrays bounded so random logits end in a few hundred tokens
S = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue", 7, None]},
    {"const": {"fixed": [1, 2, 3]}},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1, "maximum": 1}, "y": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"],
     "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["v"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/leaf"}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                          "maximum": 50}},
     "required": ["kind", "r"], "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"],
                "additionalProperties": False},
               {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
                "additionalProperties": False}]},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                      "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["id"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}],
     "items": False, "minItems": 2},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 3}}}},
     "required": ["matrix"], "additionalProperties": False},
]

MAX_STEPS = 400


def sample_batch(compiler, tokenizer, specs: list[StructuredOutputsParams], seed: int = 0,
                 free_rows: int = 0, closing_bias: float = 0.0) -> tuple[list[str], torch.Tensor]:
    """Decode every spec in one batch from seeded random logits until each grammar terminates.

    ``closing_bias`` is added to closing punctuation's logits (a model's tendency to close) so that
    unbounded JSON ends soon.
    ``free_rows`` unconstrained rows ride along at the end of the batch; returns the texts and the
    free rows' logits at the last step (to check the mask left them alone)."""
    gen = torch.Generator().manual_seed(seed)
    states = [compiler.state(s) for s in specs]
    outs: list[list[int]] = [[] for _ in specs]
    vocab = compiler.vocab_size
    bitmask = allocate_bitmask(len(specs) + free_rows, vocab)
    logits = torch.empty(0)
    closers = torch.zeros(vocab)
    closers[[tokenizer.convert_tokens_to_ids(t) for t in ("}", "]", '"', '"}', "},")]] = closing_bias
    for _ in range(MAX_STEPS):
        live = [i for i, st in enumerate(states) if not st.is_terminated()]
        if not live:
            break
        logits = torch.randn(len(specs) + free_rows, vocab, generator=gen) * 4 + closers
        free_before = logits[len(specs):].clone()
        for i in live:
            states[i].fill_bitmask(bitmask, i)
        apply_bitmask(logits, bitmask, live)
        assert torch.equal(logits[len(specs):], free_before), "unlisted rows must not be masked"
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1).tolist()
        for i in live:
            assert states[i].accept(tokens[i]), "a token the mask allowed was refused"
            outs[i].append(tokens[i])
    assert all(st.is_terminated() for st in states), f"some grammar did not finish in {MAX_STEPS} steps"
    eos = tokenizer.eos_token_id
    return [tokenizer.decode([t for t in ids if t != eos]) for ids in outs], logits[len(specs):]


def test_twenty_json_schemas_validate(compiler, tokenizer):
    texts, _ = sample_batch(compiler, tokenizer, [StructuredOutputsParams(json=s) for s in SCHEMAS], free_rows=2)
    for schema, text in zip(SCHEMAS, texts):
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 15, "random logits should give varied outputs"


def test_json_object_regex_choice_grammar(compiler, tokenizer):
    choices = ["positive", "negative", 'a "quoted" one']
    specs = [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"[A-Z][a-z]{1,6} \d{2}"),
             StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]')]
    for seed in range(3):
        obj, rx, ch, gr = sample_batch(compiler, tokenizer, specs, seed=seed, closing_bias=20.0)[0]
        assert isinstance(json.loads(obj), dict), obj
        assert re.fullmatch(r"[A-Z][a-z]{1,6} \d{2}", rx), rx
        assert ch in choices
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", gr), gr


def test_rejected_token_and_rollback(compiler, tokenizer):
    """A token outside the grammar is refused without moving the state; rollback undoes accepted tokens."""
    st = compiler.state(StructuredOutputsParams(choice=["yes", "no"]))
    (y,) = tokenizer.encode("yes", add_special_tokens=False)
    (n,) = tokenizer.encode("no", add_special_tokens=False)
    assert not st.accept(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert st.accept(y) and st.is_completed()
    st.rollback(1)
    assert not st.is_completed() and st.accept(n)
    assert st.accept(tokenizer.eos_token_id) and st.is_terminated()


def test_compile_cache_keys_on_kind_and_spec(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    reordered = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    hits = compiler.hits
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(reordered))) is first
    assert compiler.hits == hits + 1
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not compiler.compile(
        StructuredOutputsParams(grammar='root ::= "a"+'))


@pytest.mark.parametrize("kwargs, field", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "choice"),
    ({"json": "{not json"}, "json"), ({"regex": 5}, "regex"), ({"json_object": 1}, "json_object"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("spec, field", [({"regex": "(unclosed"}, "regex"), ({"grammar": "root ::= undefined_rule"},
                                                                             "grammar"),
                                         ({"json": {"type": "no-such-type"}}, "json")])
def test_uncompilable_specs_are_value_errors(compiler, spec, field):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        compiler.compile(StructuredOutputsParams(**spec))



def test_manager_masks_only_structured_rows_and_forks(tokenizer):
    """The engine's view: rows keyed by sequence id; a fork continues from the parent's position."""
    from pagedllm.structured.manager import StructuredOutputManager

    mgr = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    mgr.add("a", StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.zeros(3, len(tokenizer))
    mgr.mask(logits, ["free", "a", "other"])
    assert torch.equal(logits[[0, 2]], torch.zeros(2, len(tokenizer)))
    allowed = set(torch.nonzero(logits[1] == 0).flatten().tolist())
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    assert {yes, no} <= allowed and len(allowed) < 10
    assert mgr.accept(["free", "a"], [5, yes]) == []
    mgr.fork("a", "b")
    assert mgr.accept(["b"], [no]) == ["b"], "the fork is past 'yes': 'no' cannot follow"
    assert mgr.accept(["b"], [tokenizer.eos_token_id]) == [] and mgr.states["b"].is_terminated()
    assert not mgr.states["a"].is_terminated()
    mgr.free("a")
    assert "a" not in mgr.states

