"""The server's edge: who may call which route, how big a request may be, which Host it may name,
and text that is not valid UTF-8. Pure ASGI layers, so they run before a body is parsed and never
buffer a streamed response; every refusal is an OpenAI error body."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.protocol.sampling_params import is_text
from pagedllm.server.protocol import ErrorInfo, ErrorResponse

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt as JSON text is ~1 MiB
MAX_HEADER_BYTES = 32 << 10  # all header names and values together
# Routes that show no data: liveness probes and the dashboard's static page (its script sends the key itself).
OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/dashboard", "/dashboard/dashboard.js",
                         "/dashboard/dashboard.css"})
LOOPBACK_NAMES = ("localhost",)


def error_response(status: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                  code: str | None = None) -> None:
    await error_response(status, ErrorInfo(message=message, code=code))(scope, receive, send)


def _bearer(scope: Scope) -> bytes:
    auth = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class APIKeyMiddleware:
    """With an API key, every route that shows data needs 'Authorization: Bearer <key>' (``OPEN_ROUTES``
    do not). /metrics also takes ``metrics_token``, or is open with ``metrics_open`` (a scraper that
    cannot hold the API key), as vLLM allows. ``tenant_keys`` ({key: tenant}) are further keys, each
    naming its tenant in ``scope["state"]["tenant"]`` (see ``tenants``)."""

    def __init__(self, app: ASGIApp, api_key: str | None = None, metrics_token: str | None = None,
                 metrics_open: bool = False, tenant_keys: dict[str, str] | None = None):
        self.app = app
        self.tenants: list[tuple[bytes, str | None]] = [(api_key.encode(), None)] if api_key else []
        self.tenants += [(k.encode(), t) for k, t in (tenant_keys or {}).items()]
        self.keys = [k for k, _ in self.tenants]
        self.metrics_keys = self.keys + ([metrics_token.encode()] if metrics_token else [])
        self.metrics_open = metrics_open

    def allowed(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in OPEN_ROUTES or (path == "/metrics" and self.metrics_open):
            return True
        token = _bearer(scope)
        keys = self.metrics_keys if path == "/metrics" else self.keys
        return any(secrets.compare_digest(token, k) for k in keys)

    def tenant(self, scope: Scope) -> str | None:
        token = _bearer(scope)
        return next((t for k, t in self.tenants if secrets.compare_digest(token, k)), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed(scope):
            scope.setdefault("state", {})["tenant"] = self.tenant(scope)
        elif scope["type"] == "http":
            await _refuse(scope, receive, send, 401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
            return
        await self.app(scope, receive, send)


class SizeLimitMiddleware:
    """413 for a body over ``max_body`` bytes (declared or streamed), 431 for headers over ``max_headers``."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY_BYTES, max_headers: int = MAX_HEADER_BYTES):
        self.app = app
        self.max_body = max_body
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > self.max_headers:
            await _refuse(scope, receive, send, 431, f"request headers exceed {self.max_headers} bytes",
                          code="headers_too_large")
            return
        declared = dict(headers).get(b"content-length", b"0")
        too_big = f"request body exceeds {self.max_body} bytes"
        if not declared.isdigit() or int(declared) > self.max_body:
            await _refuse(scope, receive, send, 413, too_big, code="body_too_large")
            return
        # A chunked body has no length up front: read it here (bounded), then replay it to the app.
        buffered: list[Message] = []
        size = 0
        while scope["method"] in ("POST", "PUT", "PATCH"):
            msg = await receive()
            buffered.append(msg)
            size += len(msg.get("body", b""))
            if size > self.max_body:
                await _refuse(scope, receive, send, 413, too_big, code="body_too_large")
                return
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The Host names accepted when none are configured: no check on loopback; beyond it, the machine's
    names (and any IP literal, see ``HostCheckMiddleware``), which stops DNS-rebinding pages."""
    try:
        if ipaddress.ip_address(bind_host).is_loopback:
            return None
    except ValueError:
        if bind_host in LOOPBACK_NAMES:
            return None
    import socket

    return sorted({*LOOPBACK_NAMES, socket.gethostname(), socket.getfqdn(), bind_host} - {"0.0.0.0", "::", ""})


def _host_name(host: str) -> str:
    if host.startswith("["):  # [v6]:port
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheckMiddleware:
    """400 unless the Host header names one of ``allowed`` (case-insensitive; '*' allows any) or is an
    IP address literal: a rebinding attack needs a DNS name."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    def ok(self, host: str) -> bool:
        name = _host_name(host).lower()
        if "*" in self.allowed or name in self.allowed:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.ok(host):
                await _refuse(scope, receive, send, 400, f"Host header {host[:100]!r} is not allowed",
                              code="invalid_host")
                return
        await self.app(scope, receive, send)


_SCALARS = {str, int, float, bool, type(None)}


def _all_text(strings: Iterable[str]) -> bool:
    """True when every string encodes to UTF-8: one pass in C (joining cannot pair two lone surrogates)."""
    return is_text("".join(strings))


def bad_text_field(value: object, where: str = "") -> str | None:
    """Dotted path of the first string in ``value`` (a request model, list or dict, nested) that is not
    valid UTF-8 (a lone surrogate such as "\\ud800" from a JSON escape), or None. Iterative (a body may
    nest thousands of levels deep); a flat list of 100k strings is cleared in one pass in C."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return where
            continue
        if isinstance(value, BaseModel):
            items = [(k, getattr(value, k)) for k in type(value).model_fields] + list((value.model_extra or {}).items())
        elif isinstance(value, dict):
            if not _all_text(k for k in value if isinstance(k, str)):
                return f"{where}.<key>" if where else "<key>"
            items = value.items()
        elif isinstance(value, list):
            types = set(map(type, value))
            if types <= _SCALARS and _all_text(value if types == {str} else (v for v in value if type(v) is str)):
                continue  # a flat list of scalars, all text valid
            items = ((f"[{i}]", v) for i, v in enumerate(value))
        else:
            continue
        children = [(str(k), v) for k, v in items if isinstance(v, (str, list, dict, BaseModel))]
        for key, val in reversed(children):  # first field first
            stack.append((f"{where}{key}" if key.startswith("[") else (f"{where}.{key}" if where else key), val))
    return None
