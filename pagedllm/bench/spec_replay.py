"""Offline acceptance of a proposer: replay the target's own greedy outputs as if they had been
decoded speculatively, and count how many drafts the greedy verifier would have accepted.

Each replayed step asks the proposer for k drafts after ``prompt + output[:pos]``, verifies them
against the known next tokens with ``greedy_verify`` (the real verification code, fed one-hot
target rows), and advances by the accepted drafts + 1. Because greedy speculative output equals
greedy output, this is exactly what the engine would do; tokens per step bounds the speedup
(it ignores the cost of drafting and of the wider verify forward).

    python -m pagedllm.bench.spec_replay --method ngram -k 4      # SmolLM2 fixing typos in Wikipedia text
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from pagedllm.spec_decode.proposer import Proposer
from pagedllm.spec_decode.rejection import greedy_verify

# The copy-heavy task: an edit of a real paragraph whose answer repeats it (the issue's "editing a given real
# text"). Chosen as a task, not by acceptance; with the paragraph's end as the answer's natural end (EOS),
# SmolLM2 copies it (it rarely fixes the typos). Replay, ngram k=4, this workload's 16 first prompts: 72% of
# drafts accepted, 3.5 tokens a step; on 8 other paragraphs "Repeat the following text exactly" 82%; asked to
# edit 8 stdlib Python functions and return them whole, 57-64% (the model often rewrites the code wrongly).
COPY_TASK = "Fix the typos in the following text and return the whole corrected text:\n\n{text}"
COPY_CHARS = (500, 1500)  # paragraph length: a few hundred tokens to copy


def with_typos(text: str, rng, num: int = 3) -> str:
    """``text`` with two adjacent letters swapped inside ``num`` seeded words of 5+ letters."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    for i in rng.sample(candidates, min(num, len(candidates))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


@dataclass
class AcceptanceStats:
    num_tokens: int = 0  # output tokens replayed
    num_steps: int = 0  # target forwards speculative decoding would need
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / max(self.num_drafted, 1)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens gained per target forward: the speedup if drafting and verifying were free."""
        return self.num_tokens / max(self.num_steps, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_step": round(self.tokens_per_step, 4)}


def replay_acceptance(proposer: Proposer, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                      k: int) -> AcceptanceStats:
    """Replay every (prompt, greedy output) pair in one lock-step batch."""
    ids = [f"replay-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        proposer.start_request(rid, p)
    pos = [0] * len(prompts)
    stats = AcceptanceStats(num_tokens=sum(map(len, outputs)))
    out_vocab = 1 + max(max(o, default=0) for o in outputs)
    while True:
        live = [i for i, o in enumerate(outputs) if pos[i] < len(o)]
        if not live:
            break
        ks = [min(k, len(outputs[i]) - pos[i] - 1) for i in live]  # leave the last token to the target
        hists = [list(prompts[i]) + list(outputs[i][: pos[i]]) for i in live]
        drafts = [d[:ki] for d, ki in zip(proposer.propose(hists, ks, [ids[i] for i in live]).token_ids, ks)]
        vocab = max([out_vocab] + [1 + t for d in drafts for t in d])
        K = max(ks)
        draft_ids = torch.zeros(len(live), K, dtype=torch.int64)
        truth = torch.zeros(len(live), K + 1, dtype=torch.int64)
        for row, (i, d) in enumerate(zip(live, drafts)):
            draft_ids[row, : len(d)] = torch.tensor(d, dtype=torch.int64)
            nxt = outputs[i][pos[i]: pos[i] + K + 1]
            truth[row, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
        num_drafts = torch.tensor([len(d) for d in drafts])
        target = torch.nn.functional.one_hot(truth, vocab).float()
        gained = greedy_verify(target, draft_ids, num_drafts)
        for row, (i, got) in enumerate(zip(live, gained)):
            proposer.on_accepted(ids[i], got, int(num_drafts[row]))
            pos[i] += len(got)
            stats.num_accepted += len(got) - 1
        stats.num_drafted += int(num_drafts.sum())
        stats.num_steps += len(live)
        # a finished sequence leaves the batch
        for i in live:
            if pos[i] >= len(outputs[i]):
                proposer.finish_request(ids[i])
    return stats


def copy_workload(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    """``num`` chat prompts asking to fix the typos of a real Wikipedia paragraph and return the whole text."""
    import random

    from pagedllm.bench.workloads import chat_request_ids, wiki_articles

    rng = random.Random(seed)
    lo, hi = COPY_CHARS
    texts = [text for _, text in rng.sample([a for a in wiki_articles() if lo <= len(a[1]) <= hi], num)]
    return chat_request_ids(tokenizer, [COPY_TASK.format(text=with_typos(t, rng)) for t in texts])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="ngram", choices=("ngram", "suffix", "draft_model"))
    ap.add_argument("--num-layers", type=int, default=None, help="draft_model: self-speculative draft depth")
    ap.add_argument("-k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256, help="output length of the copy workload")
    ap.add_argument("--workload", default="copy", choices=("copy", "w1"))
    args = ap.parse_args(argv)
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.protocol import SamplingParams
    from pagedllm.spec_decode.config import SpeculativeConfig, make_proposer

    llm = LLM()
    tok = llm.engine.tokenizer
    if args.workload == "copy":
        prompts = copy_workload(tok, args.num_prompts)
        params = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(prompts)  # stops at EOS
    else:  # W1's real-text windows and output lengths
        from pagedllm.bench.workloads import W1, random_requests

        reqs = random_requests(tok, args.num_prompts, W1["prompt_range"], W1["output_range"])
        prompts = [r.prompt_ids for r in reqs]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    outputs = [o.outputs[0].token_ids for o in outs]
    for k in args.k:
        spec = {"method": args.method, "num_speculative_tokens": k}
        if args.method == "draft_model":
            spec["num_layers"] = args.num_layers
        runner = llm.engine.forward_pass
        proposer = make_proposer(SpeculativeConfig.from_dict(spec), runner.model, runner.backend)
        stats = replay_acceptance(proposer, prompts, outputs, k)
        print(json.dumps({"workload": args.workload, "method": args.method, "num_layers": args.num_layers, "k": k,
                          **stats.as_dict()}))


if __name__ == "__main__":
    main()
