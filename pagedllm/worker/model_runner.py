"""The model runner: one step's execution on the worker's device. It applies the core's
``SchedulerOutput`` (plain data) to the persistent batch, runs the forward pass (from a CUDA graph where
one is captured), and answers with a ``ModelRunnerOutput``: sampled ids, logprobs, beam top-k, prompt
logprobs and verified drafts. It knows nothing of requests or blocks' owners."""

from __future__ import annotations

import logging

import torch

from pagedllm.kv.kv_cache import KVCache
from pagedllm.lora.manager import LoRAManager
from pagedllm.models.forward_pass import ForwardPass
from pagedllm.protocol.step_io import (
    DeferredOutput,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
    SeqOutput,
)
from pagedllm.structured.state import apply_bitmask
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.host_copy import HostCopy, to_host
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.worker.noise import noise_key
from pagedllm.worker.sampler import Sampler, SamplingBatch, is_plain
from pagedllm.worker.spec_verify import verify_drafts

log = logging.getLogger("pagedllm.worker")


class ModelRunner:
    def __init__(self, forward_pass: ForwardPass, batch: InputBatch, sampler: Sampler,
                 graphs: DecodeGraphs | None, lora: LoRAManager | None = None) -> None:
        self.forward_pass = forward_pass
        self.kv_cache: KVCache = forward_pass.kv_cache
        self.batch = batch
        self.sampler = sampler
        self.graphs = graphs
        self.lora = lora  # issue 32: the adapters' slots (None: LoRA off)
        self._deferred: DeferredOutput | None = None  # the last step, answered before its ids reached the host
        self._pending: tuple[list[int], list[int], torch.Tensor] | None = None  # its rows, positions, ids (device)
        self._logits: torch.Tensor | None = None  # CPU: the steps' float32 logits, written in place (_logits_buffer)

    def _logits_buffer(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """On the CPU, a float32 ``[>= rows, vocab]`` buffer for this step's logits, kept for the next steps: a fresh
        one page-faults every step (see ``LlamaForCausalLM.compute_logits``). Each step's logits are used up within
        the step (samples, logprobs, drafts' checks and grammar masks all read them before it returns). None on
        an accelerator, whose caching allocator already reuses the memory."""
        if device.type != "cpu":
            return None
        vocab = self.forward_pass.model.config.vocab_size
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, vocab)
        return self._logits

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | DeferredOutput:
        """Run one step. With ``so.defer_output``, a decode step replayed from one graph answers before its
        sampled ids reach the host (a ``DeferredOutput``): the next step's inputs take those ids on the device,
        so the host launches step N+1 while step N's copy is still on its way, and waits for it only when it
        needs the tokens (the core folding them in, or rows that change, or a step that samples on the host)."""
        batch = self.batch
        if so.forks or so.finished_seq_ids or so.new_seqs or so.swap_out or so.swap_in or so.copies \
                or not so.defer_output:
            self._settle()  # rows are about to change, or this step answers at once: the last step's ids first
        for parent, child, index in so.forks:
            batch.fork(parent, child, index)
        for sid in so.finished_seq_ids:
            batch.remove(sid)
        for new in so.new_seqs:
            batch.add(new)
        rows = [batch.apply(s) for s in so.scheduled]
        if so.swap_out:
            self.kv_cache.swap_out(so.swap_out)
        if so.swap_in:
            self.kv_cache.swap_in(so.swap_in)
        if so.copies:
            self.kv_cache.copy_blocks(so.copies)
        for ap in so.lora_pages:  # adapters made resident this step: their weights into their KV pages
            self._lora_manager().store(ap)
        if not so.scheduled:
            return ModelRunnerOutput()
        inp = batch.prepare(so.scheduled, rows)
        if self._deferred is not None:
            self._take_pending(so, rows, inp)
        lora = None if inp.lora_ids is None else self._lora_manager().step(inp.lora_ids)
        if self.graphs is not None and lora is None and self.graphs.can_run(inp.meta) and self._plain_step(so, rows):
            return self._graph_step(so, rows, inp)
        self._settle()  # the host samples (and reads the rows' tokens) below
        if lora is not None:  # adapters run eagerly (graphs hold the base model's path)
            hidden = self.forward_pass.forward(inp.input_ids, inp.meta, lora)
            return self._outputs(so, rows, inp.order, inp.meta.query_start_loc.tolist(), hidden)
        forward = self.forward_pass.forward if self.graphs is None else self.graphs.forward
        hidden = forward(inp.input_ids, inp.meta)
        return self._outputs(so, rows, inp.order, inp.meta.query_start_loc.tolist(), hidden)

    def _settle(self) -> None:
        """Wait for the deferred step's ids and write them into the rows (a no-op when none is deferred)."""
        if self._deferred is not None:
            deferred, self._deferred, self._pending = self._deferred, None, None
            deferred.get()

    def _take_pending(self, so: SchedulerOutput, rows: list[int], inp: StepInputs) -> None:
        """This step's inputs at the places of the deferred step's sampled ids (``PENDING_TOKEN`` to the core,
        stale on the host) take those ids from the device: an index copy queued behind the step that made
        them, with no wait."""
        prev_rows, prev_pos, prev_ids = self._pending
        slot_of = {r: k for k, r in enumerate(prev_rows)}
        start, flat, dst, src = 0, {}, [], []
        for i in inp.order:
            flat[i], start = start, start + so.scheduled[i].num_tokens
        for i, s in enumerate(so.scheduled):
            k = slot_of.get(rows[i])
            if k is not None and s.num_computed <= prev_pos[k] < s.num_computed + s.num_tokens:
                dst.append(flat[i] + prev_pos[k] - s.num_computed)
                src.append(k)
        if dst:
            dev = inp.input_ids.device
            # non-blocking uploads: a blocking one would wait for the whole queue, the step in flight included
            dst_t, src_t = (torch.tensor(i, dtype=torch.int64).to(dev, non_blocking=True) for i in (dst, src))
            inp.input_ids[dst_t] = prev_ids[src_t]

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("a sequence asks for a LoRA adapter but this engine was started without enable_lora")
        return self.lora

    def _plain_step(self, so: SchedulerOutput, rows: list[int]) -> bool:
        """Every sequence samples one token with plain settings (``is_plain``): the step fits one graph."""
        return so.grammar_bitmask is None and all(
            s.needs_logits and s.num_samples == 1 and not s.beam_topk and s.prompt_logprobs is None
            and not s.spec_token_ids and is_plain(self.batch.params[r]) for s, r in zip(so.scheduled, rows))

    def _graph_step(self, so: SchedulerOutput, rows: list[int], inp: StepInputs) -> ModelRunnerOutput | DeferredOutput:
        """The whole decode step replayed from one graph; only the sampled ids and logprobs come back, at once
        or (``so.defer_output``) when first asked for."""
        batch = self.batch
        ordered = [rows[i] for i in inp.order]
        row_t = torch.tensor(ordered, dtype=torch.int64)
        positions = batch.num_tokens[row_t].clone()  # where each row's sampled id goes
        # host tensors: the graph's buffers take them by non-blocking copies (no wait for the step in flight)
        tokens, lps = self.graphs.forward_sample(inp.input_ids, inp.meta, [batch.params[r].temperature for r in ordered],
                                                 batch.noise_key[row_t], positions)
        copy = HostCopy(tokens, lps)

        def settle() -> ModelRunnerOutput:
            ids, lp = (t.tolist() for t in copy.wait())
            outs = [SeqOutput(s.seq_id) for s in so.scheduled]
            for k, i in enumerate(inp.order):
                outs[i].token_ids, outs[i].logprobs = [ids[k]], [lp[k]]
            batch.record_sampled(ordered, ids, positions)
            return ModelRunnerOutput(outs)

        if not so.defer_output:
            return settle()
        self._deferred = DeferredOutput(settle)
        self._pending = (ordered, positions.tolist(), tokens.clone())  # the buffer is the next replay's output
        return self._deferred

    def _outputs(self, so: SchedulerOutput, rows: list[int], order: list[int], qsl: list[int],
                 hidden: torch.Tensor) -> ModelRunnerOutput:
        """Logits of every row that needs them in one LM-head pass, then sampling, beam top-k and
        prompt logprobs."""
        batch = self.batch
        pos_of = {i: k for k, i in enumerate(order)}
        last_rows, prompt_spans = [], []  # hidden rows; (scheduled index, first logits row, positions)
        last_of: dict[int, int] = {}  # scheduled index -> logits row of its last token
        spec_of: dict[int, int] = {}  # scheduled index -> logits row of its last real token (drafts follow)
        for i, s in enumerate(so.scheduled):
            start = qsl[pos_of[i]]
            if s.prompt_logprobs is not None:
                num_prompt = int(batch.host.num_prompt[rows[i]])
                n = max(0, min(s.num_computed + s.num_tokens, num_prompt - 1) - s.num_computed)
                if n:
                    prompt_spans.append((i, len(last_rows), n))
                    last_rows += range(start, start + n)
            k = len(s.spec_token_ids)
            if k:
                spec_of[i] = len(last_rows)
                last_rows += range(start + s.num_tokens - 1 - k, start + s.num_tokens)
            elif s.needs_logits:
                last_of[i] = len(last_rows)
                last_rows.append(start + s.num_tokens - 1)
        outs = [SeqOutput(s.seq_id) for s in so.scheduled]
        if not last_rows:
            return ModelRunnerOutput(outs)
        # logits stay on the device: sampling runs there, and only ids and asked-for logprobs come back
        dev = hidden.device
        if last_rows != list(range(hidden.shape[0])):  # else every row, in order (a decode step): hidden itself
            hidden = hidden.index_select(0, torch.tensor(last_rows, dtype=torch.int64, device=dev))
        logits = self.forward_pass.model.compute_logits(hidden, self._logits_buffer(len(last_rows), dev))
        for i, first, n in prompt_spans:
            s = so.scheduled[i]
            row = rows[i]
            targets = batch.token_ids[row, s.num_computed + 1: s.num_computed + 1 + n].to(dev)
            ranked = _ranked(logits[first:first + n].log_softmax(-1), targets, s.prompt_logprobs)
            outs[i].prompt_logprobs = Logprobs(*to_host(ranked.token_ids, ranked.logprobs))
        if so.grammar_bitmask is not None:  # structured outputs: disallowed tokens to -inf, before sampling
            rows_g = [last_of[i] for i in so.grammar_rows if i in last_of]
            if rows_g:
                sub = so.grammar_bitmask[[i for i in so.grammar_rows if i in last_of]]
                masked = logits[rows_g]
                apply_bitmask(masked, sub)
                logits[rows_g] = masked
        sample_rows, sample_keys, beams = [], [], []
        for i, k in last_of.items():
            s = so.scheduled[i]
            if s.beam_topk:
                beams.append((i, k))
                continue
            for j in range(s.num_samples):
                sample_rows.append(k)
                sample_keys.append((i, j))
        if beams:
            idx = torch.tensor([r for _, r in beams], device=dev)
            top = logits.index_select(0, idx).log_softmax(-1).topk(max(so.scheduled[i].beam_topk for i, _ in beams))
            vals, ids = to_host(top.values, top.indices)
            for n, (i, _) in enumerate(beams):
                kk = so.scheduled[i].beam_topk
                outs[i].beam_topk = Logprobs(ids[n:n + 1, :kk], vals[n:n + 1, :kk])
        if sample_rows:
            self._sample(so, rows, logits, sample_rows, sample_keys, outs)
        if spec_of:
            idx = list(spec_of)
            kept = verify_drafts(to_host(logits)[0], list(spec_of.values()), [so.scheduled[i].spec_token_ids for i in idx],
                                 [batch.params[rows[i]] for i in idx], [batch.generators[rows[i]] for i in idx])
            for i, (toks, lps) in zip(idx, kept):
                outs[i].token_ids, outs[i].logprobs = toks, lps
        return ModelRunnerOutput(outs)

    def _sample(self, so: SchedulerOutput, rows: list[int], logits: torch.Tensor, sample_rows: list[int],
                sample_keys: list[tuple[int, int]], outs: list[SeqOutput]) -> None:
        batch = self.batch
        params, keys, brows = [], [], []
        for i, j in sample_keys:
            row = rows[i]
            p = batch.params[row]
            params.append(p)
            brows.append(row)
            # a parallel sample draws with its own sample index's key (its child row gets the same when forked)
            keys.append(int(batch.host.noise_key[row]) if j == 0 else noise_key(p.seed, j))
        try:
            self._sample_rows(logits, sample_rows, sample_keys, params, keys, brows, rows, outs)
        except Exception:
            log.exception("batched sampling failed; sampling sequence by sequence")
            for i in dict.fromkeys(i for i, _ in sample_keys):
                sel = [r for r, (ii, _) in enumerate(sample_keys) if ii == i]
                try:
                    self._sample_rows(logits, [sample_rows[r] for r in sel], [sample_keys[r] for r in sel],
                                      [params[r] for r in sel], [keys[r] for r in sel], [brows[r] for r in sel],
                                      rows, outs)
                except Exception as e:  # noqa: BLE001 - reported for this sequence alone
                    outs[i].token_ids, outs[i].logprobs = [], []
                    outs[i].error = f"sampling failed: {type(e).__name__}: {e}"

    def _sample_rows(self, logits: torch.Tensor, sample_rows: list[int], sample_keys: list[tuple[int, int]],
                     params: list, keys: list[int], brows: list[int], rows: list[int], outs: list[SeqOutput]) -> None:
        batch = self.batch
        num_tokens = torch.from_numpy(batch.host.num_tokens[brows])  # copies (numpy gathers), for this step
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        hist = batch.token_ids[torch.tensor(brows), : int(num_tokens.max())] if penalised else batch.token_ids[:0]
        # every row once, in order (a decode step without beams or parallel samples): the logits themselves, not a
        # [rows, vocab] copy (6 ms a step at 64 rows of SmolLM2's 49152 on a 2-core Xeon; the sampler never writes
        # its input)
        picked = logits if sample_rows == list(range(logits.shape[0])) else logits.index_select(
            0, torch.tensor(sample_rows, device=logits.device))
        result = self.sampler(picked,
                              SamplingBatch(params, torch.tensor(keys, dtype=torch.int64), hist,
                                            torch.from_numpy(batch.host.num_prompt[brows]), num_tokens))
        tokens, chosen = (t.tolist() for t in to_host(result.token_ids, result.logprobs))
        for r, (i, j) in enumerate(sample_keys):
            out = outs[i]
            out.token_ids.append(tokens[r])
            out.logprobs.append(chosen[r])
        firsts = [r for r, (_, j) in enumerate(sample_keys) if j == 0]
        batch.record_sampled([brows[r] for r in firsts], [tokens[r] for r in firsts])
        if result.top_ids is not None:
            top_ids, top_vals = to_host(result.top_ids, result.top_logprobs)
            for i in dict.fromkeys(i for i, _ in sample_keys):
                p = batch.params[rows[i]]
                if p.logprobs is None:
                    continue
                sel = [r for r, (ii, _) in enumerate(sample_keys) if ii == i]
                width = 1 + p.logprobs
                outs[i].top_logprobs = Logprobs(top_ids[sel, :width], top_vals[sel, :width])


def _ranked(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """Each position's actual next token first, then the top ``k`` (prompt logprobs, vLLM's shape)."""
    chosen = logprobs.gather(1, targets[:, None])
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        return Logprobs(torch.cat([targets[:, None], ids], 1), torch.cat([chosen, vals], 1))
    return Logprobs(targets[:, None].clone(), chosen)
