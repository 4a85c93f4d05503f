"""The offline Python API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import time
from typing import Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.config.args import EngineArgs
from pagedllm.frontend.llm_engine import LLMEngine
from pagedllm.protocol.lora_request import LoRARequest
from pagedllm.protocol.outputs import RequestOutput
from pagedllm.frontend.prompt_inputs import PromptInput, normalize_prompts
from pagedllm.protocol.sampling_params import SamplingParams


class LLM:
    """``LLM(model=None)`` loads the embedded SmolLM2-135M-Instruct; engine settings are keyword args, with the
    offline defaults of :meth:`EngineArgs.offline` (longer CPU steps than the server's)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs.offline(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion under continuous batching; outputs in prompt order.

        ``lora_request``: one adapter for every prompt, or one per prompt (None: the base model); prompts
        of different adapters run in the same batches. All prompts, settings and adapters are validated
        before any is scheduled, so a bad one raises ValueError and nothing runs.
        """
        prompts = normalize_prompts(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        eng = self.engine
        for p, sp in zip(prompts, params_list):
            eng.validate(eng.tokenize(p)[1], sp)
        for lora in loras:
            eng.check_lora(lora)
        reqs = [eng.add_request(p, sp, cache_salt=cache_salt, lora_request=lr)
                for p, sp, lr in zip(prompts, params_list, loras)]
        return self._run(reqs, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's cached-free blocks (see ``LLMEngine.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.engine
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        t0, gen0 = time.monotonic(), eng.stats.generation_tokens
        shown = t0  # the bar's rate, at most twice a second (formatting it every step cost ~1% of a batch-1 step)
        while pending:
            for out in eng.step():
                if out.error is not None and out.request_id in pending:
                    for rid in pending - {out.request_id}:
                        eng.abort_request(rid)
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    final[out.request_id] = out
                    bar.update(1)
            now = time.monotonic()
            if use_tqdm and now - shown >= 0.5:
                shown = now
                bar.set_postfix(tok_s=f"{(eng.stats.generation_tokens - gen0) / (now - t0):.1f}",
                                run=eng.scheduler.num_running_seqs(), wait=len(eng.scheduler.waiting), refresh=False)
        bar.close()
        return [final[r] for r in request_ids]


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids for a conversation, ending with the assistant's turn; shared by ``LLM`` and the server."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
