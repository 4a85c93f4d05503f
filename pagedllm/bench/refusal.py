"""``pagedllm bench refusal``: what oversized input costs the server (issue 34, item 2).

A ``pagedllm serve`` subprocess; an attacker thread sends, back to back, a 10 MB body, a 7.9 MB prompt
(over the context by its length alone), a 100k-value enum schema and a 6 MB ``/tokenize``, and times
each refusal; meanwhile victim clients stream short completions and record their TTFT. Quiet and attack
phases alternate in the same run, so the TTFT ratio attack/quiet is a same-run comparison. For scale,
the time to tokenize the 7.9 MB prompt in full (what the server did before refusing it) is measured too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from pagedllm.bench.report import Report, Table

BIG_PROMPT = "lorem ipsum " * (7_900_000 // 12)
ATTACKS = {  # name: (path, body text)
    "10 MB body": ("/v1/completions", json.dumps({"prompt": "x" * 10_000_000, "max_tokens": 4})),
    "7.9 MB prompt": ("/v1/completions", json.dumps({"prompt": BIG_PROMPT, "max_tokens": 4})),
    "100k-value enum": ("/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "guided_json": {"enum": [f"v{i}" for i in range(100_000)]}})),
    "6 MB /tokenize": ("/tokenize", json.dumps({"prompt": BIG_PROMPT[:6_000_000]})),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase-s", type=float, default=None, help="seconds per quiet or attack phase (default 10; quick 3)")
    p.add_argument("--rounds", type=int, default=None, help="quiet/attack pairs (default 2; quick 1)")
    p.add_argument("--victims", type=int, default=2, help="streaming clients measuring TTFT")


def _victim(url: str, stop: threading.Event, ttfts: list[float]) -> None:
    import httpx

    body = {"prompt": "Hello, how are you?", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            first = None
            with http.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():  # read to the end: the next request waits for this one
                    if first is None and line.startswith("data: ") and '"text":' in line:
                        first = time.perf_counter() - t0
            if first is not None:
                ttfts.append(first)


def _attacker(url: str, stop: threading.Event, refusals: dict[str, list[tuple[int, float]]]) -> None:
    import httpx

    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            for name, (path, text) in ATTACKS.items():
                t0 = time.perf_counter()
                r = http.post(url + path, content=text, headers={"Content-Type": "application/json"})
                refusals[name].append((r.status_code, time.perf_counter() - t0))


def _phase(url: str, victims: int, seconds: float, attack: bool, refusals: dict) -> list[float]:
    stop, ttfts = threading.Event(), []
    threads = [threading.Thread(target=_victim, args=(url, stop, ttfts)) for _ in range(victims)]
    if attack:
        threads.append(threading.Thread(target=_attacker, args=(url, stop, refusals)))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return ttfts


def run(args) -> Report:
    from pagedllm.bench.latency import _free_port, start_server, stop_server
    from pagedllm.models.loader import load_checkpoint, load_tokenizer

    phase_s = args.phase_s or (3.0 if args.quick else 10.0)
    rounds = args.rounds or (1 if args.quick else 2)
    port = _free_port()
    proc, status = start_server(args, port)
    if proc is None:
        raise SystemExit(f"bench refusal: {status}")
    url = f"http://127.0.0.1:{port}"
    refusals: dict[str, list[tuple[int, float]]] = {name: [] for name in ATTACKS}
    quiet, attacked = [], []
    try:
        _phase(url, args.victims, 2.0, False, refusals)  # warm-up
        for _ in range(rounds):
            quiet += _phase(url, args.victims, phase_s, False, refusals)
            attacked += _phase(url, args.victims, phase_s, True, refusals)
    finally:
        stop_server(proc)
    tokenize_s = None
    if not args.quick:
        tok = load_tokenizer(load_checkpoint(None).path)
        t0 = time.perf_counter()
        tok(BIG_PROMPT)
        tokenize_s = time.perf_counter() - t0
    med = {k: 1000 * statistics.median(t for _, t in v) if v else None for k, v in refusals.items()}
    codes = {k: sorted({c for c, _ in v}) for k, v in refusals.items()}
    ttft = [1000 * statistics.median(quiet), 1000 * statistics.median(attacked)]
    rep = Report("refusal", "Refusing oversized input: refusal latency and other clients' TTFT",
                 [f"{args.victims} victims streaming 4-token completions; attack and quiet phases of {phase_s:g} s "
                  f"alternating x{rounds}; medians"])
    rep.tables.append(Table(["input", "status", "refused in (ms)", "requests"],
                            [[k, ",".join(map(str, codes[k])), med[k], len(refusals[k])] for k in ATTACKS], digits=1))
    rep.tables.append(Table(["victim TTFT", "quiet (ms)", "under attack (ms)", "attack / quiet", "samples"],
                            [["p50", ttft[0], ttft[1], ttft[1] / ttft[0], f"{len(quiet)} / {len(attacked)}"]],
                            digits=2))
    if tokenize_s is not None:
        rep.notes.append(f"tokenizing the 7.9 MB prompt in full (what the server did before refusing it): "
                         f"{tokenize_s:.1f} s")
    rep.result = {"refusal_ms": med, "status": codes, "ttft_ms": {"quiet": ttft[0], "attack": ttft[1]},
                  "ttft_samples": {"quiet": len(quiet), "attack": len(attacked)}, "tokenize_full_s": tokenize_s}
    return rep
