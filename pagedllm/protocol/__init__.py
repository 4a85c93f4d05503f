"""Plain data that crosses a boundary (API -> front end -> engine core -> worker and back): sampling
params, step and core I/O, outputs, limits, logit bias, errors. Imports nothing of pagedllm but the
structured-output types."""

from pagedllm.protocol.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]
