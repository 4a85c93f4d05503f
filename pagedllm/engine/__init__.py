"""Continuous-batching engine: scheduler, sampler, sequences, sync and async front ends."""

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams

__all__ = ["EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
