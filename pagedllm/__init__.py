"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

__version__ = "0.1.0"

from pagedllm.engine import EngineArgs, RequestOutput, SamplingParams  # noqa: E402


def __getattr__(name: str):
    """``LLM`` loads torch models; import it lazily so ``import pagedllm`` stays cheap."""
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput"]
