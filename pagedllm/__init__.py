"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

from pagedllm import cpu_env

# OpenMP's wait policy and spin, huge pages, malloc arenas: read once at start, so set before torch loads (only
# effective when pagedllm is imported first; the user's settings win)
cpu_env.set_defaults()

from pagedllm.config.host_memory import keep_freed_memory  # noqa: E402

# each step's activations stay in the heap instead of being faulted in afresh (see host_memory)
keep_freed_memory()

from pagedllm.config.args import EngineArgs  # noqa: E402
from pagedllm.config.version import __version__  # noqa: E402
from pagedllm.protocol import RequestOutput, SamplingParams  # noqa: E402


def __getattr__(name: str):
    """``LLM`` loads torch models; import it lazily so ``import pagedllm`` stays cheap."""
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "__version__"]
