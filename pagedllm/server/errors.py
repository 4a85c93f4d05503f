"""The error every route raises for a client's mistake, rendered in OpenAI's error shape."""

from __future__ import annotations

from pagedllm.server.protocol import ErrorInfo


class APIError(Exception):
    """An error the client caused (or must hear about), rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
