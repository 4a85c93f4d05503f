"""Tenants by default: ``--api-keys-file`` maps each API key to a tenant, and every request's prefix
cache is salted with its tenant, so one tenant never hits (and so can never time, or read in
``cached_tokens``) blocks another tenant's prompt put in the cache. A client's own ``cache_salt``
still splits its tenant's cache further.

The file holds one ``KEY TENANT`` pair a line (blank lines and ``#`` comments skipped); several
keys may name one tenant.
"""

from __future__ import annotations

import json

from starlette.requests import Request


def load_api_keys(path: str) -> dict[str, str]:
    """{key: tenant} from ``path``; ValueError naming the line for anything malformed."""
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT', got {len(parts)} fields")
            key, tenant = parts
            if key in keys:
                raise ValueError(f"{path}:{n}: a key appears twice")
            keys[key] = tenant
    if not keys:
        raise ValueError(f"{path}: no API keys")
    return keys


def request_tenant(request: Request) -> str | None:
    """The tenant the request's API key belongs to (set by ``APIKeyMiddleware``), or None."""
    return request.scope.get("state", {}).get("tenant")


def tenant_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant's (with its own salt, if any, inside it)."""
    if tenant is None:
        return client_salt
    return json.dumps(["tenant", tenant, client_salt])
