"""A worker on one device: the model, the KV tensors, the attention backend, the persistent
batch and the sampler. It knows nothing of requests or blocks' owners: each step it applies the
core's ``SchedulerOutput`` (plain data) and answers with a ``ModelRunnerOutput``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedllm.attention import BACKENDS, get_backend
from pagedllm.engine.args import EngineArgs, resolve_device, resolve_dtype
from pagedllm.engine.step_io import Logprobs, ModelRunnerOutput, SchedulerOutput, SeqOutput
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_quant import resolve_kv_cache_dtype
from pagedllm.model_runner import ModelRunner
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_checkpoint
from pagedllm.worker import cuda_graphs
from pagedllm.worker.input_batch import InputBatch, make_generator
from pagedllm.worker.sampler import Sampler, SamplingBatch
from pagedllm.worker.spec_verify import verify_drafts
from pagedllm.structured.state import apply_bitmask

log = logging.getLogger("pagedllm.worker")


@dataclass
class KVCacheSpec:
    """What the worker's pool holds, for the core's KV manager."""

    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_name: str
    quantization: str
    dtype: str
    kv_dtype: str
    backend: str
    device: str
    kv_pool: dict  # KVCache.describe(): dtype, bytes per token (scales included), capacity in tokens


def backend_for(device: torch.device, requested: str) -> str:
    """The attention backend for ``device``: what was asked, or the fastest one that runs there
    (triton on CUDA, the C++ kernel on the CPU, else compiled flex)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "triton" if "triton" in BACKENDS else "flex"
    return "cpu" if "cpu" in BACKENDS else "flex"


class Worker:
    """``tp``: this worker's tensor-parallel group; it then holds its rank's shard of the model and its
    share of every KV block (its kv heads), the block tables being the same on every rank."""

    def __init__(self, args: EngineArgs, tp=None) -> None:
        self.device = resolve_device(args.device)
        ckpt = load_checkpoint(args.model)
        cfg = ckpt.config
        dtype = resolve_dtype(args.dtype, self.device)
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(args.kv_cache_dtype)
        quantization = args.quantization if self.device.type == "cpu" else "none"  # block GEMMs are CPU kernels
        if tp is not None:
            from pagedllm.distributed.sharding import kv_heads_per_rank, load_shard

            model = load_shard(ckpt, tp, dtype, quantization).to(self.device)
            num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp.world_size)
        else:
            model = LlamaForCausalLM.from_checkpoint(ckpt, dtype, quantization).to(self.device)
            num_kv_heads = cfg.num_kv_heads
        eos = list(cfg.eos_token_ids)
        tok_eos = ckpt.tokenizer.eos_token_id
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        del ckpt
        dims = (cfg.num_layers, num_kv_heads, cfg.head_dim, args.block_size, kv_dtype)
        if args.num_blocks is not None:
            num_blocks = args.num_blocks
        elif args.kv_cache_memory is not None:
            num_blocks = KVCache.num_blocks_for_budget(args.kv_cache_memory, *dims)
        else:
            num_blocks = KVCache.num_blocks_for_memory_fraction(args.kv_cache_fraction, *dims)
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block; raise --kv-cache-memory")
        num_host_blocks = KVCache.num_blocks_for_budget(args.swap_space, *dims) if args.swap_space else 0
        if args.preemption_mode == "swap" and num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (bytes)")
        self.kv_cache = KVCache(cfg.num_layers, num_kv_heads, cfg.head_dim, num_blocks, args.block_size,
                                dtype=kv_dtype, num_host_blocks=num_host_blocks, device=self.device)
        backend = backend_for(self.device, args.attention_backend)
        self.runner = ModelRunner(model, self.kv_cache, get_backend(backend))
        max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.graphs = self._decode_graphs(args, tp, kv_dtype, max_model_len)
        if self.graphs is not None:
            num_blocks -= 1  # the last block is the graphs' scratch block: the KV manager never hands it out
        self.batch = InputBatch(max_model_len, args.block_size, cfg.vocab_size, self.device)
        self.sampler = Sampler(eos)
        self._pending_generators: dict[tuple[int, int], torch.Generator | None] = {}
        self.spec = KVCacheSpec(num_blocks, num_host_blocks, args.block_size, max_model_len, cfg.vocab_size, eos,
                                args.model or "SmolLM2-135M-Instruct", model.quantization, str(dtype).split(".")[-1],
                                str(kv_dtype).split(".")[-1], backend, str(self.device), self.kv_cache.describe())

    @property
    def model(self) -> LlamaForCausalLM:
        return self.runner.model

    def _decode_graphs(self, args: EngineArgs, tp, kv_dtype: torch.dtype,
                       max_model_len: int) -> cuda_graphs.DecodeGraphs | None:
        """Graphs for decode steps (captured now) where they apply: a device that captures them (CUDA), not
        ``enforce_eager``, a backend whose decode is capturable, one rank (all-reduces inside graphs are not
        set up), a pool whose writes don't wait on the host (int8's block-scale update does) and a spare block."""
        capture = None if args.enforce_eager else cuda_graphs.graph_capture(self.device)
        if capture is None:
            return None
        reasons = [why for why, bad in (
            (f"the {self.runner.backend.name!r} backend", not getattr(self.runner.backend, "graph_safe", False)),
            ("tensor parallelism", tp is not None), ("an int8 KV cache", kv_dtype == torch.int8),
            ("a one-block pool", self.kv_cache.num_blocks < 2)) if bad]
        if reasons:
            log.info("decode steps run eagerly (no CUDA graphs) with %s", ", ".join(reasons))
            return None
        graphs = cuda_graphs.DecodeGraphs(self.runner, args.max_num_seqs, max_model_len,
                                          scratch_block=self.kv_cache.num_blocks - 1, capture=capture)
        graphs.capture_all()
        return graphs

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.batch
        for parent, child, index in so.forks:
            gen = self._pending_generators.pop((parent, index), None)
            if gen is None:
                gen = make_generator(batch.params[batch.row_of[parent]], index)
            batch.fork(parent, child, index, gen)
        for sid in so.finished_seq_ids:
            batch.remove(sid)
        if so.finished_seq_ids:
            gone = set(so.finished_seq_ids)
            self._pending_generators = {k: g for k, g in self._pending_generators.items() if k[0] not in gone}
        for new in so.new_seqs:
            batch.add(new)
        rows = [batch.apply(s) for s in so.scheduled]
        if so.swap_out:
            self.kv_cache.swap_out(so.swap_out)
        if so.swap_in:
            self.kv_cache.swap_in(so.swap_in)
        if so.copies:
            self.kv_cache.copy_blocks(so.copies)
        if not so.scheduled:
            return ModelRunnerOutput()
        inp = batch.prepare(so.scheduled, rows)
        forward = self.runner.forward if self.graphs is None else self.graphs.forward
        hidden = forward(inp.input_ids, inp.meta)
        return self._outputs(so, rows, inp.order, inp.meta.query_start_loc.tolist(), hidden)

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
                num_prompt = int(batch.num_prompt[rows[i]])
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
        logits = self.runner.model.compute_logits(hidden.index_select(
            0, torch.tensor(last_rows, dtype=torch.int64, device=hidden.device))).cpu()
        for i, first, n in prompt_spans:
            s = so.scheduled[i]
            row = rows[i]
            targets = batch.token_ids[row, s.num_computed + 1: s.num_computed + 1 + n]
            outs[i].prompt_logprobs = _ranked(logits[first:first + n].log_softmax(-1), targets, s.prompt_logprobs)
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
            idx = torch.tensor([r for _, r in beams])
            vals, ids = logits.index_select(0, idx).log_softmax(-1).topk(max(so.scheduled[i].beam_topk for i, _ in beams))
            for n, (i, _) in enumerate(beams):
                kk = so.scheduled[i].beam_topk
                outs[i].beam_topk = Logprobs(ids[n:n + 1, :kk], vals[n:n + 1, :kk])
        if sample_rows:
            self._sample(so, rows, logits, sample_rows, sample_keys, outs)
        if spec_of:
            idx = list(spec_of)
            kept = verify_drafts(logits, list(spec_of.values()), [so.scheduled[i].spec_token_ids for i in idx],
                                 [batch.params[rows[i]] for i in idx], [batch.generators[rows[i]] for i in idx])
            for i, (toks, lps) in zip(idx, kept):
                outs[i].token_ids, outs[i].logprobs = toks, lps
        return ModelRunnerOutput(outs)

    def _sample(self, so: SchedulerOutput, rows: list[int], logits: torch.Tensor, sample_rows: list[int],
                sample_keys: list[tuple[int, int]], outs: list[SeqOutput]) -> None:
        batch = self.batch
        params, gens, brows = [], [], []
        for i, j in sample_keys:
            row = rows[i]
            p = batch.params[row]
            params.append(p)
            brows.append(row)
            if j == 0:
                gens.append(batch.generators[row])
            else:  # a parallel sample's generator: it goes to the child row when the core forks it
                g = make_generator(p, j)
                self._pending_generators[(so.scheduled[i].seq_id, j)] = g
                gens.append(g)
        try:
            self._sample_rows(logits, sample_rows, sample_keys, params, gens, brows, rows, outs)
        except Exception:  # noqa: BLE001 - find the sequence(s) it belongs to; the others still get tokens
            log.exception("batched sampling failed; sampling sequence by sequence")
            for i in dict.fromkeys(i for i, _ in sample_keys):
                sel = [r for r, (ii, _) in enumerate(sample_keys) if ii == i]
                try:
                    self._sample_rows(logits, [sample_rows[r] for r in sel], [sample_keys[r] for r in sel],
                                      [params[r] for r in sel], [gens[r] for r in sel], [brows[r] for r in sel],
                                      rows, outs)
                except Exception as e:  # noqa: BLE001 - reported for this sequence alone
                    outs[i].token_ids, outs[i].logprobs = [], []
                    outs[i].error = f"sampling failed: {type(e).__name__}: {e}"

    def _sample_rows(self, logits: torch.Tensor, sample_rows: list[int], sample_keys: list[tuple[int, int]],
                     params: list, gens: list, brows: list[int], rows: list[int], outs: list[SeqOutput]) -> None:
        batch = self.batch
        brow_t = torch.tensor(brows, dtype=torch.int64)
        num_tokens = batch.num_tokens[brow_t]
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        hist = batch.token_ids[brow_t, : int(num_tokens.max())] if penalised else batch.token_ids[:0]
        result = self.sampler(logits.index_select(0, torch.tensor(sample_rows)),
                              SamplingBatch(params, gens, hist, batch.num_prompt[brow_t], num_tokens))
        tokens, chosen = result.token_ids.tolist(), result.logprobs.tolist()
        for r, (i, j) in enumerate(sample_keys):
            out = outs[i]
            out.token_ids.append(tokens[r])
            out.logprobs.append(chosen[r])
        if result.top_ids is not None:
            for i in dict.fromkeys(i for i, _ in sample_keys):
                p = batch.params[rows[i]]
                if p.logprobs is None:
                    continue
                sel = [r for r, (ii, _) in enumerate(sample_keys) if ii == i]
                width = 1 + p.logprobs
                outs[i].top_logprobs = Logprobs(result.top_ids[sel, :width], result.top_logprobs[sel, :width])


def _ranked(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """Each position's actual next token first, then the top ``k`` (prompt logprobs, vLLM's shape)."""
    chosen = logprobs.gather(1, targets[:, None])
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        return Logprobs(torch.cat([targets[:, None], ids], 1), torch.cat([chosen, vals], 1))
    return Logprobs(targets[:, None].clone(), chosen)
