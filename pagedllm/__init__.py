"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when another busy process
# shares the cores (measured here: a decode step 7x slower with 2 spinning threads); sleeping
# waiters cost little. Only effective when pagedllm is imported before torch; the user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

from pagedllm.engine import EngineArgs, RequestOutput, SamplingParams  # noqa: E402


def __getattr__(name: str):
    """``LLM`` loads torch models; import it lazily so ``import pagedllm`` stays cheap."""
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput"]
