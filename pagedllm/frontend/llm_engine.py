"""The synchronous front end: tokenize and validate, hand requests to the engine core, turn its
token-id deltas into ``RequestOutput``s (output processor), step until done.

The core (scheduler + KV manager) runs in this process; its worker runs here too or in a child
process (``distributed_executor_backend``). ``pagedllm.frontend.async_engine`` is the streaming
front end, with the core in a thread or in its own process.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from pagedllm.config.args import EngineArgs
from pagedllm.core.engine_core import EngineCore
from pagedllm.lora.registry import LoRARegistry, check_lora
from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.lora_request import LoRARequest
from pagedllm.protocol.limits import RequestLimits
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.protocol.outputs import RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.models.loader import load_tokenizer

log = logging.getLogger("pagedllm.engine")


def tokenize_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text or as token ids; ValueError for anything else."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
        return None, list(prompt)
    raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        t0 = time.monotonic()
        torch.manual_seed(args.seed)
        self.core = EngineCore(args)
        spec = self.core.spec
        self.tokenizer = load_tokenizer(args.model)
        self.processor = OutputProcessor(self.tokenizer)
        self.limits: RequestLimits = self.core.limits
        self.model_name = spec.model_name
        self.max_model_len = spec.max_model_len
        self.eos_token_ids = list(spec.eos_token_ids)
        self._ids = itertools.count()
        self.loras = LoRARegistry.from_args(args)  # issue 32: served adapters (None without enable_lora)
        log.info("engine ready in %.1f s: %s on %s, dtype %s, kv %s, %d blocks of %d tokens (%d tokens), "
                 "backend %s, executor %s", time.monotonic() - t0, self.model_name, spec.device, spec.dtype,
                 spec.kv_dtype, spec.num_blocks, spec.block_size, spec.num_blocks * spec.block_size, spec.backend,
                 args.distributed_executor_backend)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt, self.limits.vocab_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything that can be wrong with a request, checked before it is scheduled."""
        self.limits.check(prompt_ids, params)

    def check_lora(self, lora: LoRARequest | None) -> None:
        """ValueError unless ``lora`` (None: the base model) can serve here: LoRA on, the adapter loads and fits."""
        check_lora(self.loras, lora)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request; returns its id. ValueError (nothing queued) for a bad prompt, settings or adapter."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # keep the prompt's last N tokens, as vLLM
            text, ids = None, ids[-params.truncate_prompt_tokens:]
        self.validate(ids, params)
        self.check_lora(lora_request)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.processor.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        now = time.monotonic()
        self.core.add_request(EngineCoreRequest(rid, ids, params, cache_salt, now, lora_request=lora_request))
        self.processor.add_request(rid, text, ids, params, now)
        return rid

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self.processor.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the cumulative outputs of the requests that made progress."""
        outputs, stops = self.processor.process(self.core.step())
        for rid, index, stop in stops:
            self.core.finish_seq(rid, index, "stop", stop)
        return outputs

    # ------------------------------------------------------------------ views
    @property
    def kv(self):
        """The core's KV manager (in-process core only): tests and integrity checks read it."""
        return self.core.kv

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def stats(self):
        return self.core.stats

    @property
    def forward_pass(self):
        """The worker's forward pass (model, KV cache, backend), when the worker runs in this process."""
        worker = getattr(self.core.executor, "worker", None)
        if worker is None:
            raise AttributeError("the worker runs in another process (distributed_executor_backend='mp')")
        return worker.forward_pass

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (as vLLM's ``reset_prefix_cache``; blocks of running requests keep
        theirs), e.g. so a benchmark's second pass over the same prompts computes them again. Returns how
        many were dropped."""
        return self.core.reset_prefix_cache()

    def pool_stats(self) -> dict:
        return self.core.pool_stats()

    def shutdown(self) -> None:
        self.core.shutdown()
