"""The main job: a batch of chat requests on the embedded model through the paged engine.

Prints each answer, the throughput, how much prompt was served from the prefix cache
(every request shares one system prompt) and the pool's state after the run.
"""

from __future__ import annotations

import argparse
import logging
import time

from pagedllm.entrypoints.llm import LLM
from pagedllm.protocol import SamplingParams

SYSTEM = ("You are a concise assistant. Answer in one or two sentences, plainly, "
          "without lists, and never repeat the question.")
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "What does a CPU do?",
    "Name a planet with rings.", "What is photosynthesis?", "Who wrote Hamlet?",
    "What is the boiling point of water at sea level?", "What is a prime number?",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    llm = LLM(args.model)
    print(f"engine ready in {time.monotonic() - t0:.1f} s")
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t1 = time.monotonic()
    # the first request fills the prefix cache with the shared system prompt; the rest run as one
    # continuous batch and read those blocks instead of recomputing them
    outs = llm.chat(convs[:1], sp, use_tqdm=False) + llm.chat(convs[1:], sp)
    elapsed = time.monotonic() - t1
    for q, o in zip(QUESTIONS, outs):
        print(f"\nQ: {q}\nA: {o.outputs[0].text.strip()}")
    eng = llm.engine
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    ttft = sorted(o.metrics.ttft for o in outs)
    print(f"\n{len(outs)} requests, {gen} tokens generated in {elapsed:.2f} s = {gen / elapsed:.1f} tok/s; "
          f"first token after {ttft[0]:.2f} s (median {ttft[len(ttft) // 2]:.2f} s)")
    print(f"prompt tokens: {prompt}, served from the prefix cache: {cached} ({100 * cached / prompt:.0f}%)")
    eng.kv.check_integrity()
    print(f"pool after the run: {eng.kv.stats()} (integrity check passed)")


if __name__ == "__main__":
    main()
