"""OpenAI request fields that cannot change a text model's output (``store``, ``metadata``, ``service_tier``,
``user``, ``modalities: ["text"]``, ``reasoning_effort``...): accepted, as vLLM accepts them, and never silently.

A response names the ones it ignored in the ``IGNORED_FIELDS_HEADER`` header, and the log says once per field
(per process) that it is ignored.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

log = logging.getLogger("pagedllm.server")

IGNORED_FIELDS_HEADER = "x-pagedllm-ignored-fields"

# why each one cannot change what this server generates
_WHY = {
    "store": "responses are not stored for distillation or evals",
    "metadata": "request tags for OpenAI's dashboard",
    "service_tier": "OpenAI's processing tier; there is one tier here",
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prompt_cache_key": "OpenAI's cache routing hint; the prefix cache matches prompts by content",
    "modalities": "text is the only output modality",
    "reasoning_effort": "reasoning budget of OpenAI's reasoning models",
}

_logged: set[str] = set()
_lock = threading.Lock()


class InertFields(BaseModel):
    """Mixed into the chat and completions requests: typed, so a wrong type is still a 400."""

    model_config = ConfigDict(strict=True, extra="allow")

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    modalities: list[Literal["text"]] | None = None  # "audio" would change the output: a 400 from validation
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def ignored_fields(self) -> list[str]:
        """The inert fields this request set, in declaration order."""
        return [name for name in _WHY if getattr(self, name, None) is not None]


def mark_ignored(response: Response, body: Any) -> Response:
    """Name ``body``'s ignored fields on ``response`` and log each field the first time any request sets it."""
    names = body.ignored_fields() if isinstance(body, InertFields) else []
    if names:
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(names)
        with _lock:
            new = [n for n in names if n not in _logged]
            _logged.update(new)
        for name in new:
            log.info("request field %r is accepted and ignored: %s (logged once)", name, _WHY[name])
    return response
