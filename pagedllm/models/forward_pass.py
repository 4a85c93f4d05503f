"""ForwardPass: one forward pass of the model over a flat batch on the paged pool. ``forward``
takes a built batch (what the worker's persistent batch gives it); ``execute`` builds one from
per-sequence chunks (tests, benchmarks, standalone use) and returns last-token logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class SeqChunk:
    """One sequence's share of a step."""

    token_ids: list[int]  # the tokens computed this step
    num_computed: int  # tokens of this sequence already in the cache (= start position)
    block_table: list[int]  # physical blocks covering at least num_computed + len(token_ids) tokens
    needs_logits: bool = True  # False for a prefill chunk that is not the prompt's last


@dataclass
class StepStats:
    num_tokens: int = 0
    num_seqs: int = 0
    num_decodes: int = 0
    extra: dict = field(default_factory=dict)


class ForwardPass:
    def __init__(self, model, kv_cache, backend):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.last_step = StepStats()
        self.threads = None  # a pagedllm.ops.cpu_threads.ThreadGovernor (the worker's, on a CPU): times each step

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], copies=()) -> torch.Tensor:
        """Apply CoW ``copies``, run one forward over every chunk, return float32 logits
        ``[number of chunks with needs_logits, vocab]`` in input order."""
        if copies:
            self.kv_cache.copy_blocks(list(copies))
        vocab = self.model.config.vocab_size
        if not chunks:
            return torch.empty((0, vocab), dtype=torch.float32)
        for c in chunks:
            if not c.token_ids:
                raise ValueError("a SeqChunk must carry at least one token")
        # decodes (one query token) first, as AttentionMetadata requires; stable otherwise
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        ordered = [chunks[i] for i in order]
        query_lens = [len(c.token_ids) for c in ordered]
        seq_lens = [c.num_computed + n for c, n in zip(ordered, query_lens)]
        dev = self.kv_cache.data.device
        meta = AttentionMetadata.build(query_lens, seq_lens, [c.block_table for c in ordered], self.block_size)
        meta = meta.to(dev)
        input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in ordered)), dtype=torch.int64,
                                 device=dev)
        hidden = self.forward(input_ids, meta)
        # last token of each chunk needing logits, in input order
        ends = meta.query_start_loc.tolist()
        pos_of = {orig: k for k, orig in enumerate(order)}
        rows = [ends[pos_of[i] + 1] - 1 for i, c in enumerate(chunks) if c.needs_logits]
        if not rows:
            return torch.empty((0, vocab), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        """Hidden states ``[T, E]`` of one flat batch whose metadata is already built (the worker's
        persistent batch builds it from tensors); K/V of every token are written to the pool. ``lora``: the
        step's per-token adapters (``pagedllm.lora.delta.LoRAStep``), None for the base model alone."""
        started = None if self.threads is None else self.threads.begin(meta.num_tokens)
        hidden = self.model(input_ids, meta.positions, self.kv_cache, meta, self.backend, lora)
        if started is not None:
            self.threads.end(meta.num_tokens, started)
        self.last_step = StepStats(meta.num_tokens, meta.num_seqs, meta.num_decodes)
        return hidden


def greedy_generate(
    runner: ForwardPass,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int | None = None,
    first_block: int = 0,
    prefill_chunk: int | None = None,
    return_logits: bool = False,
):
    """Greedy decoding of all ``prompts`` packed in one batch (tests and benchmarks).

    Blocks are handed out sequentially from ``first_block`` (no KV manager). With
    ``prefill_chunk`` the prompts are prefilled in chunks of at most that many tokens per
    sequence per step. Returns the ``max_new_tokens`` generated ids of each prompt (no EOS stop);
    with ``return_logits`` also each prompt's float32 logits ``[max_new_tokens, vocab]``.
    """
    bs = block_size or runner.block_size
    tables, nxt = [], first_block
    for p in prompts:
        n = -(-(len(p) + max_new_tokens) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    if nxt > runner.kv_cache.num_blocks:
        raise ValueError(f"greedy_generate needs {nxt} blocks; the KV cache has {runner.kv_cache.num_blocks}")
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens of each sequence already in the cache
    out: list[list[int]] = [[] for _ in prompts]
    all_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in out):
        chunks, owners = [], []
        for i, s in enumerate(seqs):
            if len(out[i]) >= max_new_tokens:
                continue
            end = len(s) if prefill_chunk is None else min(len(s), done[i] + prefill_chunk)
            chunks.append(SeqChunk(s[done[i] : end], done[i], tables[i], needs_logits=end == len(s)))
            owners.append(i)
        logits = runner.execute(chunks)
        next_ids = logits.argmax(-1).tolist()
        k = 0
        for c, i in zip(chunks, owners):
            done[i] += len(c.token_ids)
            if c.needs_logits:
                tok = next_ids[k]
                k += 1
                out[i].append(tok)
                seqs[i].append(tok)
                if return_logits:
                    all_logits[i].append(logits[k - 1])
    if return_logits:
        return out, [torch.stack(x) for x in all_logits]
    return out
