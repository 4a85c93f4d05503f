"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

__version__ = "0.1.0"
