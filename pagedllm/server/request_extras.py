"""Request fields beyond the core sampling ones: OpenAI's ``response_format`` and ``logit_bias``,
vLLM's structured-output extras (``structured_outputs``, ``guided_*``) and sampling extras, and
the check that no field the server does not know passes silently."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.structured import StructuredOutputsParams

log = logging.getLogger("pagedllm.server")


class _Extra(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class JsonSchemaFormat(_Extra):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Extra):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Extra):
    """vLLM's ``structured_outputs`` request object: one of these keys."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingExtras(_Extra):
    """Mixed into both endpoints' requests."""

    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    speculative: bool = True  # False: this request opts out of speculative decoding
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request sets, or None; ValueError naming the
        fields when it sets more than one."""
        given: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given["response_format"] = StructuredOutputsParams(json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or not rf.json_schema.schema_:
                raise ValueError("response_format.json_schema.schema is required for type json_schema")
            given["response_format"] = StructuredOutputsParams(json=rf.json_schema.schema_)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given["structured_outputs"] = StructuredOutputsParams(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice, grammar=so.grammar)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        if len(given) > 1:
            raise ValueError(f"{next(iter(given))} conflicts with {', '.join(list(given)[1:])}: "
                             "set one structured-output constraint")
        return next(iter(given.values()), None)

    def extra_sampling_kwargs(self, vocab_size: int) -> dict[str, Any]:
        """SamplingParams keyword arguments for these fields; ValueError naming the field."""
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for key, val in self.logit_bias.items():
                if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                    raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
                bias[int(key)] = val
        return {"logit_bias": bias, "best_of": self.best_of, "include_stop_str_in_output":
                self.include_stop_str_in_output, "truncate_prompt_tokens": self.truncate_prompt_tokens,
                "structured_outputs": self.structured_params(), "speculative": self.speculative}


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of every field in ``model`` (nested models and lists of them included) that no
    model declares: pydantic keeps them in ``model_extra`` with ``extra="allow"``."""
    found = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        val = getattr(model, name)
        items = val if isinstance(val, list) else [val]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(val, list) else f"{prefix}{name}."
                found += unknown_fields(item, where)
    return found


def check_unknown_fields(body: BaseModel, allow: bool) -> None:
    """ValueError naming the unknown fields; with ``allow`` (the server's --allow-unknown-fields)
    a logged warning instead."""
    names = unknown_fields(body)
    if not names:
        return
    msg = f"unknown or unsupported field{'s' if len(names) > 1 else ''}: {', '.join(names)}"
    if not allow:
        raise ValueError(msg)
    log.warning("%s (ignored: --allow-unknown-fields)", msg)
