"""Every spec that used to reach the engine and fail there (or be silently weakened) is refused up front
with a ValueError naming what is wrong; legitimate specs, recursive trees included, still pass."""

from __future__ import annotations

import json
import pickle

import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.admission import GrammarAdmission
from pagedllm.structured.limits import StructuredLimits, check_limits


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_SCHEMAS = {  # name: (schema, words the error must contain)
    "ref_root": ({"$ref": "#"}, "reference cycle"),
    "ref_self_def": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "reference cycle"),
    "ref_mutual": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                   "reference cycle"),
    "nested_400": (nested(400), "nested deeper"),
    "not_anything": ({"not": {}}, "'not'"),
    "enum_empty": ({"enum": []}, "enum"),
    "enum_100k": ({"enum": list(range(100_000))}, "values"),
    "enum_2000x2000": ({"enum": ["x" * 2000 + str(i) for i in range(2000)]}, "characters"),
    "ref_remote": ({"$ref": "https://example.com/schema.json"}, "not a local reference"),
    "ref_file": ({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}, "not a local reference"),
    "ref_unresolved": ({"$ref": "#/$defs/missing"}, "does not resolve"),
    "false": (False, "structured_outputs"),
}


@pytest.fixture(scope="module")
def admission(tokenizer):
    gate = GrammarAdmission(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield gate
    gate.shutdown()


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_bad_schema_is_refused_naming_the_problem(admission, name):
    schema, words = BAD_SCHEMAS[name]
    for spec in (schema, json.dumps(schema)):  # as an object and as JSON text
        with pytest.raises(ValueError, match="structured_outputs") as e:
            admission.admit(StructuredOutputsParams(json=spec))
        assert words in str(e.value), str(e.value)


def test_deep_json_text_is_refused_without_recursion_error(admission):
    text = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    with pytest.raises(ValueError, match="structured_outputs.json"):
        admission.admit(StructuredOutputsParams(json=text))


def test_choice_regex_and_grammar_limits():
    limits = StructuredLimits()
    for params, words in ((StructuredOutputsParams(choice=[str(i) for i in range(100_000)]), "values"),
                          (StructuredOutputsParams(choice=["y" * 2000] * 2000), "characters"),
                          (StructuredOutputsParams(regex="a" * 10_000), "regex"),
                          (StructuredOutputsParams(grammar='root ::= "a"' + " " * 100_000), "grammar"),
                          (StructuredOutputsParams(json={"type": "string", "pattern": "b" * 10_000}), "pattern")):
        with pytest.raises(ValueError, match=words):
            check_limits(params, limits)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}, "required": ["name"]},
    {"$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"not": {"type": "string"}, "enum": {"enum": ["a", "b"]}}},  # keywords as names
    nested(32),
])
def test_legitimate_schemas_pass_and_pickle_flat(admission, schema):
    params = admission.admit(StructuredOutputsParams(json=schema))
    assert isinstance(params.json, str) and json.loads(params.json) == schema  # text: pickles without recursion
    assert pickle.loads(pickle.dumps(params)) == params


def test_choice_regex_grammar_pass(admission):
    for params in (StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[0-9]{3}"),
                   StructuredOutputsParams(grammar='root ::= "a" | "b"'), StructuredOutputsParams(json_object=True)):
        assert admission.admit(params) == params


def test_slow_compile_is_killed_at_its_deadline_and_the_refusal_is_cached(tokenizer):
    """Four 2,000-character enum strings take seconds to compile: refused at the deadline, the compiling
    process killed (its CPU back), the same spec again refused without compiling, and the next spec
    gets a fresh worker."""
    import psutil

    admission = GrammarAdmission(tokenizer, len(tokenizer), [tokenizer.eos_token_id], compile_timeout_s=0.5)
    slow = StructuredOutputsParams(json={"enum": [f"{i}" + "z" * 2000 for i in range(4)]})
    try:
        admission.admit(StructuredOutputsParams(regex="[a-z]{3}"))  # the worker is up
        pid = admission.worker.pid
        for _ in range(2):
            with pytest.raises(ValueError, match="took longer than 0.5 s to compile"):
                admission.admit(slow)
            assert admission.worker.pid is None  # killed, not restarted for the cached refusal
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        admission.admit(StructuredOutputsParams(choice=["a", "b"]))
        assert admission.worker.pid not in (None, pid)
    finally:
        admission.shutdown()
