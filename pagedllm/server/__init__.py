"""OpenAI-compatible HTTP server: ``create_app(engine)``; ``pagedllm serve`` runs it under uvicorn."""

from pagedllm.server.app import create_app

__all__ = ["create_app"]
