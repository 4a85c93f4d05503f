"""Limits a structured-output spec must meet before anything compiles it, checked without recursion.

A schema can be small on the wire and still cost seconds to compile (a 100k-value enum), fail only
once generation starts (a ``$ref`` cycle, which leaves no token allowed), be silently weakened
(a remote ``$ref`` or a ``not``, which the compiler drops) or be too deep to pickle for the engine
process. ``check_limits`` refuses each of these with a ValueError naming the field and the place in
the schema, in time linear in the spec's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.structured.params import StructuredOutputsParams

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "if", "then", "else",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class StructuredLimits:
    """What one request's constraint may hold (OpenAI's strict mode allows 5 levels and 500 enum values;
    these are looser, sized so that the worst spec compiles in well under a second)."""

    max_depth: int = 128  # nesting of JSON objects and arrays anywhere in a schema (a property is 2 levels)
    max_nodes: int = 10_000  # objects and arrays in a schema
    max_entries: int = 2_048  # entries of one object or array (checked by length: a 100k-value enum costs nothing)
    max_enum_values: int = 2_048  # enum and const values (and choices) in one spec, together
    max_enum_chars: int = 65_536  # their total length as JSON text
    max_pattern_chars: int = 4_096  # one regex (a schema's "pattern", or a regex constraint)
    max_grammar_chars: int = 65_536  # an EBNF grammar


def check_limits(params: StructuredOutputsParams, limits: StructuredLimits) -> None:
    """ValueError naming ``structured_outputs.<kind>`` and what is wrong, if ``params`` is over a limit
    or uses what the compiler would drop or cannot finish."""
    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        _check_schema(schema, limits)
    elif kind == "regex":
        _check_len("regex", params.regex, limits.max_pattern_chars)
    elif kind == "grammar":
        _check_len("grammar", params.grammar, limits.max_grammar_chars)
    elif kind == "choice":
        _check_values("choice", params.choice, limits)


def _check_len(kind: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ValueError(f"structured_outputs.{kind} is {len(text)} characters; the limit is {limit}")


def _check_values(where: str, values: list[Any], limits: StructuredLimits) -> None:
    if len(values) > limits.max_enum_values:
        raise ValueError(f"structured_outputs.{where} has {len(values)} values; the limit is "
                         f"{limits.max_enum_values}")
    chars = sum(len(json.dumps(v)) for v in values)
    if chars > limits.max_enum_chars:
        raise ValueError(f"structured_outputs.{where} values total {chars} characters; the limit is "
                         f"{limits.max_enum_chars}")


def _check_shape(schema: Any, limits: StructuredLimits) -> None:
    """Depth and node count of the raw JSON, iteratively (a 10,000-deep schema must not recurse)."""
    if not isinstance(schema, (dict, list)):
        return
    stack, nodes = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ValueError(f"structured_outputs.json has more than {limits.max_nodes} objects and arrays")
        if depth > limits.max_depth:
            raise ValueError(f"structured_outputs.json is nested deeper than {limits.max_depth} levels")
        if len(value) > limits.max_entries:
            raise ValueError(f"structured_outputs.json has an {'object' if isinstance(value, dict) else 'array'} of "
                             f"{len(value)} values; the limit is {limits.max_entries}")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _subschemas(node: dict, path: str) -> list[tuple[Any, str]]:
    out = []
    for key in _ONE + ("not",):
        if isinstance(node.get(key), dict):
            out.append((node[key], f"{path}/{key}"))
    for key in _LIST:
        if isinstance(node.get(key), list):
            out.extend((s, f"{path}/{key}/{i}") for i, s in enumerate(node[key]))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out.extend((s, f"{path}/{key}/{name}") for name, s in node[key].items())
    return out


def _resolve(root: Any, ref: str, where: str) -> Any:
    """The subschema a local ``$ref`` names (JSON pointer, RFC 6901); ValueError for any other reference."""
    if ref != "#" and not ref.startswith("#/"):
        raise ValueError(f"structured_outputs.json: $ref {ref[:200]!r} at {where} is not a local reference "
                         "('#' or '#/...'); remote and file references are not fetched")
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"structured_outputs.json: $ref {ref[:200]!r} at {where} does not resolve")
    return node


def _check_ref_chain(root: Any, node: dict, where: str) -> None:
    """A schema that is only a reference to itself, however many hops away, matches no finite text."""
    seen = {id(node)}
    while isinstance(node.get("$ref"), str):
        node = _resolve(root, node["$ref"], where)
        if not isinstance(node, dict):
            return
        if id(node) in seen:
            raise ValueError(f"structured_outputs.json: the $ref at {where} is a reference cycle "
                             "(a schema that only refers to itself matches nothing)")
        seen.add(id(node))


def _check_schema(schema: Any, limits: StructuredLimits) -> None:
    _check_shape(schema, limits)
    values, stack = [], [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        if "not" in node:
            raise ValueError(f"structured_outputs.json: 'not' at {path} is not supported (it cannot be enforced "
                             "while generating)")
        if "enum" in node:
            if not isinstance(node["enum"], list) or not node["enum"]:
                raise ValueError(f"structured_outputs.json: enum at {path} must be a non-empty array "
                                 "(an empty enum matches nothing)")
            values.extend(node["enum"])
        if "const" in node:
            values.append(node["const"])
        if isinstance(node.get("pattern"), str) and len(node["pattern"]) > limits.max_pattern_chars:
            raise ValueError(f"structured_outputs.json: pattern at {path} is {len(node['pattern'])} characters; "
                             f"the limit is {limits.max_pattern_chars}")
        if "$ref" in node:
            if not isinstance(node["$ref"], str):
                raise ValueError(f"structured_outputs.json: $ref at {path} must be a string")
            _check_ref_chain(schema, node, path)
        stack.extend(_subschemas(node, path))
    _check_values("json enum/const", values, limits)
