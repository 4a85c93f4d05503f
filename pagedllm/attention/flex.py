"""FlexAttention over the paged pool, in place (no dense gather), compiled with torch.compile.

The whole pool of one layer is the key "sequence": K = ``k_cache[None]`` of shape
``[1, Hkv, num_slots, D]``; queries are the flat batch ``[1, H, T, D]`` (``enable_gqa``).
Sparsity comes from a BlockMask built directly from the block tables, once per step in
``prepare()`` and shared by every layer:

* flex's KV block is 16 slots whenever block_size divides 16 or is a multiple of 16 (one compiled
  kernel for every block size >= 16);
  a Q block holds queries of ONE sequence: each decode is one Q block whose ``group`` query heads
  are folded into the Q dim (q as ``[1, Hkv, decodes * group, D]``, so each K/V row is read once
  per decode; group 1 is padded to 2 rows), prefill chunks (``enable_gqa``) are padded to multiples of ``prefill_q_block`` queries (pad rows repeat the chunk's last query and
  are dropped), so each Q block lists exactly the flex KV blocks of its sequence up to its last
  position: ``kv_indices`` rows come from the block table (``from_kv_blocks``, no dense
  T x num_slots mask is ever built; ``compute_q_blocks=False``).
* ``mask_mod`` (exact, evaluated inside the kernel): allow iff the kv slot's block belongs to the
  query's sequence and its logical position <= the query's position. The slot -> logical map is
  per sequence (``phys_to_logical[seq, slot // min(block_size, 16)]``, -1 elsewhere) because a block may be shared by
  several sequences of the batch (prefix caching, forks).

Decodes and prefill chunks are two flex calls (two Q block sizes, each compiled once per dtype
and GQA group). On CUDA, inductor's Triton flex template tiles Q and KV blocks by BLOCK_M x BLOCK_N and refuses
sparse blocks its tiles do not divide (its default tiles are 64-128 wide, our blocks 16-32), so the calls name
the tiles: BLOCK_M = the Q block, BLOCK_N = the KV block, a decode's Q block padded to 16 rows (tl.dot's least),
IEEE fp32 (the template's default is TF32), and never the flex_decoding kernel (its split-KV layout assumes one
dense block mask per head).
``torch.compile(flex_attention, dynamic=True)`` is compiled once per process and reused; a new
step with another T or batch size does not recompile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.kv.kv_quant import QuantizedKV

_compiled: dict[str, object] = {}
_patched = False


def _patch_inductor_cpu_flex_template() -> None:
    """Work around an inductor bug (torch 2.13, CPU flex template with dynamic shapes).

    ``CppFlexAttentionTemplate.modification`` renames the split-size size variables with a plain
    ``str.replace`` of e.g. ``ks5``, which also rewrites ``ks58`` into ``cur_kvSplitSize8`` and the
    generated C++ fails to compile. We re-create the method with a word-bounded regex instead;
    a torch whose source differs is left alone.
    """
    global _patched
    if _patched:
        return
    _patched = True
    try:
        import inspect
        import re
        import textwrap

        import torch._inductor.lowering  # noqa: F401  (import order: avoids a circular import)
        from torch._inductor.codegen import cpp_flex_attention_template as mod

        cls = mod.CppFlexAttentionTemplate
        src = textwrap.dedent(inspect.getsource(cls.modification))
        pat = re.compile(r"output_code\.replace\(\s*(kernel_group\.args\.sizevars\[\w+\]),\s*(\"cur_\w+\")\s*\)")
        if len(pat.findall(src)) != 2:
            return
        src = pat.sub(r'__import__("re").sub(r"\\b" + __import__("re").escape(\1) + r"\\b", \2, output_code)', src)
        ns: dict = {}
        exec(compile(src, inspect.getsourcefile(cls), "exec"), mod.__dict__, ns)
        cls.modification = ns["modification"]
    except Exception:  # best effort: leave inductor untouched
        return


def compiled_flex_attention(kind: str):
    """The process-wide compiled flex_attention for ``kind`` ("decode" or "prefill"), compiled on
    first call and reused. Two separate compiled functions: recompiling one function for the second
    call pattern trips an inductor CPU flex-template codegen bug (undeclared ``cur_qSplitSize1``)."""
    _patch_inductor_cpu_flex_template()
    fn = _compiled.get(kind)
    if fn is None:
        fn = _compiled[kind] = torch.compile(flex_attention, dynamic=True)
    return fn


@dataclass
class _Part:
    """One flex call: a run of query tokens (decodes, or prefill chunks) and its BlockMask."""

    token_index: torch.Tensor | None  # rows of the padded query -> flat-batch token (None: identity slice)
    out_rows: torch.Tensor | None  # rows of the padded output that are real tokens
    start: int
    end: int  # flat-batch token range [start, end)
    block_mask: BlockMask | None
    tensors: tuple  # (kv_num_blocks, kv_indices, seq_of_row, pos_of_row) before the pool size is known


@dataclass
class _StepState:
    meta_id: int
    num_slots: int | None
    phys_to_logical: torch.Tensor | None
    parts: list
    build_s: float = 0.0
    gran: int = 0


def _flex_geometry(block_size: int, kv_block: int) -> tuple[int, int, int]:
    """(flex KV block size, pool blocks per flex block m, flex blocks per pool block e).

    The flex KV block is ``kv_block`` (16) whenever block_size divides it or is a multiple of it,
    so every block size compiles to the same kernel; otherwise it is block_size itself."""
    if kv_block % block_size == 0:
        return kv_block, kv_block // block_size, 1
    if block_size % kv_block == 0:
        return kv_block, 1, block_size // kv_block
    return block_size, 1, 1


def _kv_blocks_for_rows(tables, n_logical, m, e):
    """Per Q block: the flex KV blocks covering ``tables[r, :n_logical[r]]`` (sorted, unique)."""
    rows, dev = tables.shape[0], tables.device
    width = max(int(n_logical.max()) if rows else 0, 1)
    valid = torch.arange(width, device=dev)[None, :] < n_logical[:, None]
    pool_ids = tables[:, :width].long()
    if e > 1:  # each pool block spans e flex blocks
        pool_ids = (pool_ids[:, :, None] * e + torch.arange(e, device=dev)).reshape(rows, width * e)
        valid = valid[:, :, None].expand(rows, width, e).reshape(rows, width * e)
    if m == 1:
        kv_num = valid.sum(1).to(torch.int32)
        ids = torch.where(valid, pool_ids, 0)
    else:  # m pool blocks per flex block: dedupe
        big = 1 << 40  # sentinel sorts last
        ids = torch.where(valid, pool_ids // m, big).sort(dim=1).values
        dup = torch.zeros_like(valid)
        dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
        ids = torch.where(dup, big, ids).sort(dim=1).values
        kv_num = (ids < big).sum(1).to(torch.int32)
        ids = torch.where(ids < big, ids, 0)
    return kv_num, ids.to(torch.int32)


class FlexBackend:
    name = "flex"
    graph_safe = False  # prepare() builds the step's BlockMask from host-side lists

    def __init__(self, prefill_q_block: int = 32, min_kv_block: int = 16, group: int | None = None) -> None:
        self.prefill_q_block = prefill_q_block
        self.min_kv_block = min_kv_block
        self._num_slots: int | None = None  # learnt from the first forward; the pool size is fixed
        self._group = group  # GQA group, learnt from the first forward when not given
        self.last_prepare_s = 0.0

    # ---- per-step structures -------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        t0 = time.perf_counter()
        bs, dev = meta.block_size, meta.positions.device
        _, m, e = _flex_geometry(bs, self.min_kv_block)
        tables = meta.block_tables
        seq_lens = meta.seq_lens.long()
        n_seq_blocks = (seq_lens + bs - 1) // bs
        parts = []
        nd = meta.num_decodes
        qsl = meta.query_start_loc.long()
        if nd > 0:
            # one Q block per decode: its `group` query heads folded into the Q dim (see forward)
            rows_per = self._decode_rows(meta)
            kv_num, kv_idx = _kv_blocks_for_rows(tables[:nd], n_seq_blocks[:nd], m, e)
            row_seq = torch.repeat_interleave(torch.arange(nd, dtype=torch.int32, device=dev), rows_per)
            pos = torch.repeat_interleave(meta.positions[:nd].to(torch.int32), rows_per)
            parts.append(_Part(None, None, 0, nd, None, (kv_num, kv_idx, row_seq, pos, rows_per)))
        if nd < meta.num_seqs:
            qb = self.prefill_q_block
            qlens = torch.tensor(meta.query_lens_list[nd:], dtype=torch.int64, device=dev)
            seqs = torch.arange(nd, meta.num_seqs, device=dev)
            n_qb = (qlens + qb - 1) // qb
            qb_seq = torch.repeat_interleave(seqs, n_qb)  # sequence of each Q block
            qb_first = torch.cumsum(n_qb, 0) - n_qb
            # Q block # in chunk
            qb_local = torch.arange(int(n_qb.sum()), device=dev) - torch.repeat_interleave(qb_first, n_qb)
            row_seq = torch.repeat_interleave(qb_seq, qb)
            row_in_chunk = torch.repeat_interleave(qb_local, qb) * qb + torch.arange(qb, device=dev).repeat(len(qb_seq))
            qlen_row = qlens[row_seq - nd]
            real = row_in_chunk < qlen_row
            row_in_chunk_c = torch.minimum(row_in_chunk, qlen_row - 1)  # pad rows repeat the last query
            token_index = qsl[row_seq] + row_in_chunk_c
            pos = meta.positions[token_index].to(torch.int32)
            last_pos = pos.view(-1, qb)[:, -1].long()
            kv_num, kv_idx = _kv_blocks_for_rows(tables[qb_seq], last_pos // bs + 1, m, e)
            out_rows = torch.nonzero(real).squeeze(1)
            start = int(qsl[nd])
            parts.append(
                _Part(token_index - start, out_rows, start, meta.num_tokens, None,
                      (kv_num, kv_idx, row_seq.to(torch.int32), pos, qb))
            )
        state = _StepState(id(meta), None, None, parts)
        meta.extra["flex"] = state
        n_known = self._num_slots
        if n_known is not None and meta.num_seqs and int(meta.block_tables.max()) < n_known // meta.block_size:
            self._finish(state, meta, n_known)  # else deferred to the first forward (pool size changed)
        state.build_s = time.perf_counter() - t0
        self.last_prepare_s = state.build_s

    def _decode_rows(self, meta: AttentionMetadata) -> int:
        return _decode_rows(self._group or meta.extra.get("gqa_group") or 1, meta.positions.device)

    def _finish(self, state: _StepState, meta: AttentionMetadata, num_slots: int) -> None:
        """Size-dependent part: phys->logical map over the pool and the BlockMasks."""
        bs, dev = meta.block_size, meta.positions.device
        kv_bs, m, e = _flex_geometry(bs, self.min_kv_block)
        n_flex = -(-num_slots // kv_bs)
        B = meta.num_seqs
        seq_lens = meta.seq_lens.long()
        n_seq_blocks = (seq_lens + bs - 1) // bs
        width = meta.block_tables.shape[1]
        valid = torch.arange(width, device=dev)[None, :] < n_seq_blocks[:, None]
        # map granularity: min(block_size, 16) slots, so all block sizes >= 16 share one kernel
        gran = min(bs, self.min_kv_block) if bs % min(bs, self.min_kv_block) == 0 else bs
        per = bs // gran  # map entries per pool block
        p2l = torch.full((B, -(-n_flex * kv_bs // gran)), -1, dtype=torch.int32, device=dev)
        b_idx = torch.arange(B, device=dev)[:, None].expand(B, width)[valid]
        phys = meta.block_tables.long()[valid]
        logical = torch.arange(width, device=dev)[None, :].expand(B, width)[valid]
        sub = torch.arange(per, device=dev)
        p2l[b_idx[:, None], phys[:, None] * per + sub] = (logical[:, None] * per + sub).to(torch.int32)
        state.phys_to_logical = p2l
        state.gran = gran
        for part in state.parts:
            kv_num, kv_idx, row_seq, pos, q_bs = part.tensors
            n_qb = kv_num.shape[0]
            full_idx = torch.zeros((1, 1, n_qb, n_flex), dtype=torch.int32, device=dev)
            w = min(kv_idx.shape[1], n_flex)
            full_idx[0, 0, :, :w] = kv_idx[:, :w]
            mask_mod = _make_mask_mod(p2l, row_seq, pos, gran)
            part.block_mask = BlockMask.from_kv_blocks(
                kv_num.view(1, 1, n_qb),
                full_idx,
                BLOCK_SIZE=(q_bs, kv_bs),
                mask_mod=mask_mod,
                seq_lengths=(row_seq.shape[0], num_slots),
                compute_q_blocks=False,
            )
        state.num_slots = num_slots

    # ---- attention -----------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(k_cache, QuantizedKV):
            # int8 / fp8 blocks cannot be read in place through flex (torch 2.13, checked):
            # - the output is sum_j p_j v_j over the V tensor flex is given: score_mod sees scores, never loaded
            #   values, and inductor's flex templates load K/V themselves (no prologue fusion), so a
            #   `.to(float) * scale` before the call is a dequantized copy of the pool;
            # - CPU: the compiled C++ flex template raises "Mixed query, key, and value dtype is not supported on
            #   this platform"; eager flex accepts int8 / fp8 K/V but upcasts them into dense scores over the pool;
            # - CUDA: the Triton template casts K/V codes to q's dtype as it loads them (allow_lowp_kv), so K's
            #   scale fits in score_mod (score * k_scale[head, block]) and fp8's per-head V scale in the output,
            #   but int8's per-block V scale needs a second pass (log-scale in score_mod, renormalised by the two
            #   passes' log-sum-exps). Not built: it cannot be verified without a GPU.
            raise ValueError(f"kv_cache_dtype {k_cache.dtype}: the flex backend reads float pools only (flex "
                             "attention cannot dequantize V as it loads it); use attention_backend 'cpu', 'triton' "
                             "or 'reference'")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.forward_attend(q, k_cache, v_cache, meta, scale)

    def forward_attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention only (the step's K/V already in the pool)."""
        state = meta.extra.get("flex")
        if state is None:
            self.prepare(meta)
            state = meta.extra["flex"]
        num_slots = k_cache.shape[1]
        if state.num_slots != num_slots:
            t0 = time.perf_counter()
            self._num_slots = num_slots
            self._finish(state, meta, num_slots)
            state.build_s += time.perf_counter() - t0
        kd = k_cache.dtype
        K = k_cache.unsqueeze(0)
        V = v_cache.unsqueeze(0)
        out = q.new_empty(q.shape)
        H, D = q.shape[1], q.shape[2]
        Hkv = k_cache.shape[0]
        group = H // Hkv
        for part in state.parts:
            if part.token_index is None:  # decodes, GQA folded: [1, Hkv, nd * rows, D], Q block = rows
                rows = part.tensors[4]
                if rows != _decode_rows(group, q.device):  # prepare() guessed the group wrong
                    self._group = group
                    self.prepare(meta)
                    return self.forward_attend(q, k_cache, v_cache, meta, scale)
                nd = part.end - part.start
                qd = q[: nd].view(nd, Hkv, group, D)
                if rows != group:  # pad rows repeat the group's heads; their outputs are dropped
                    qd = qd[:, :, torch.arange(rows, device=qd.device) % group]
                qd = qd.to(kd).permute(1, 0, 2, 3).reshape(1, Hkv, nd * rows, D)
                o = compiled_flex_attention("decode")(qd, K, V, block_mask=part.block_mask, scale=scale,
                                                      kernel_options=_kernel_options(part.block_mask, q.device, kd))
                o = o.view(Hkv, nd, rows, D)[:, :, :group].permute(1, 0, 2, 3).reshape(nd, H, D)
                out[: nd] = o.to(q.dtype)
                continue
            qp = q[part.start : part.end].index_select(0, part.token_index)
            qp = qp.to(kd).transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]
            fa = compiled_flex_attention("prefill")
            o = fa(qp, K, V, block_mask=part.block_mask, scale=scale, enable_gqa=True,
                   kernel_options=_kernel_options(part.block_mask, q.device, kd))
            o = o[0].transpose(0, 1).index_select(0, part.out_rows)  # [tokens, H, D]
            out[part.start : part.end] = o.to(q.dtype)
        return out


def _decode_rows(group: int, device: torch.device) -> int:
    """Rows per decode Q block: the GQA group, padded to 16 rows on CUDA (the Triton template's least tile) and to
    2 on the CPU (inductor's CPU flex template fails to compile a dynamic-shape kernel with Q blocks of 1 row)."""
    if device.type == "cuda":
        return -(-group // 16) * 16
    return group * (2 if group == 1 else 1)


def _kernel_options(block_mask: BlockMask, device: torch.device, dtype: torch.dtype) -> dict | None:
    """On CUDA: the Triton template's tiles are our sparse blocks (it refuses blocks its tiles do not divide), fp32
    in IEEE, and the main kernel always (see the module's docstring); None (inductor's choice) elsewhere."""
    if device.type != "cuda":
        return None
    q_bs, kv_bs = block_mask.BLOCK_SIZE
    opts = {"BLOCK_M": q_bs, "BLOCK_N": kv_bs, "FORCE_USE_FLEX_ATTENTION": True}
    if dtype == torch.float32:
        opts["FLOAT32_PRECISION"] = "'ieee'"
    return opts


def _make_mask_mod(p2l: torch.Tensor, row_seq: torch.Tensor, pos: torch.Tensor, gran: int):
    """``p2l[seq, slot // gran]`` = logical index (in units of ``gran`` slots) of that slot range
    in ``seq``, or -1 when the range is not part of ``seq``."""

    def paged_causal(b, h, q_idx, kv_idx):
        logical = p2l[row_seq[q_idx], kv_idx // gran]
        return (logical >= 0) & (logical * gran + kv_idx % gran <= pos[q_idx])

    return paged_causal
