"""What a structured output must match: exactly one of a JSON schema, any JSON object, a regex,
a choice of strings or an EBNF grammar (vLLM's ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar/GBNF dialect), root rule ``root``
    # (start, end) markers of a reasoning part, e.g. ("<think>", "</think>"): the grammar applies only after
    # the reasoning ends (set by the server under --reasoning-parser); None: from the first token
    reasoning: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field: exactly one kind, each of the right type."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object or its JSON text, got {self.json!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to parse
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, str) or not val):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {val!r}")
        if self.reasoning is not None and (len(self.reasoning) != 2 or not all(
                isinstance(m, str) and m for m in self.reasoning)):
            raise ValueError(f"structured_outputs.reasoning must be (start, end) marker strings, got {self.reasoning!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec text): the compile cache's key, equal for equal specs however spelled."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)

