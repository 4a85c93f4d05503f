"""Where one first token's time goes through the real serving stack (issue 36), request by request.

The server's app runs under uvicorn in this process with the engine core in its own process, as ``pagedllm
serve`` runs it. Each request is stamped at its hand-overs: the client's send, ``AsyncEngine.generate``'s entry
(HTTP parse, validation and limits done), the core's own ``first_scheduled_time`` and ``first_token_time``,
``AsyncEngine._on_outputs``' entry (the first token back over the pipe) and exit (detokenized, pushed to the
event loop), and the client's first SSE chunk; all ``time.monotonic``, one clock across the processes. The
same prompt's offline prefill (``LLM.generate``, ``max_tokens=1``) runs after each, alternating. The stamps
wrap two ``AsyncEngine`` methods in this process only: a diagnostic, not a bench.

    python scripts/ttft_trace.py --num-prompts 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from pagedllm.frontend.async_engine import AsyncEngine

STAMPS: dict[str, dict] = {}
_generate, _on_outputs = AsyncEngine.generate, AsyncEngine._on_outputs


def generate(self, prompt, params, request_id, *args, **kwargs):
    STAMPS.setdefault(request_id, {})["arrive"] = time.monotonic()
    return _generate(self, prompt, params, request_id, *args, **kwargs)


def on_outputs(self, outs) -> None:
    back = time.monotonic()
    first = [STAMPS.setdefault(o.request_id, {}) for o in outs]
    first = [(d, o) for d, o in zip(first, outs) if "back" not in d]
    for d, o in first:
        d.update(back=back, sched=o.metrics.first_scheduled_time, token=o.metrics.first_token_time)
    _on_outputs(self, outs)  # the client may read its chunk before this returns: "done" comes last
    done = time.monotonic()
    for d, _ in first:
        d["done"] = done


def main() -> None:
    import httpx
    import uvicorn

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.serve_procs import free_port
    from pagedllm.bench.workloads import random_requests
    from pagedllm.config.args import EngineArgs
    from pagedllm.entrypoints.llm import apply_chat_template
    from pagedllm.server import create_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--prompt-len", default="32-256", help="LO-HI prompt tokens")
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.prompt_len.split("-"))
    AsyncEngine.generate, AsyncEngine._on_outputs = generate, on_outputs
    eng = AsyncEngine(EngineArgs(dtype="float32", max_model_len=2048))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(eng, served_model_name="m"), host="127.0.0.1", port=port,
                                        log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    llm = LLM(dtype="float32", max_model_len=2048)
    client = httpx.Client(timeout=60)

    def served(ids: list[int]) -> tuple[float, float, str]:
        body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        t0 = time.monotonic()
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    return t0, time.monotonic(), json.loads(line[5:])["id"]
        raise RuntimeError("no text chunk")

    def offline(ids: list[int]) -> float:
        t0 = time.monotonic()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        return time.monotonic() - t0

    try:
        for w in random_requests(eng.tokenizer, 3, (40, 200), (1, 1), a.seed + 88):  # warm-up, both paths
            served(w.prompt_ids)
            offline(w.prompt_ids)
        reqs = random_requests(eng.tokenizer, a.num_prompts, (lo, hi), (1, 1), a.seed)
        rows = []
        for r in reqs:
            time.sleep(0.3)  # one request at a time, the offline run's threads gone quiet
            t0, t1, rid = served(r.prompt_ids)
            d = next(v for k, v in STAMPS.items() if k.startswith(rid))
            deadline = time.monotonic() + 10
            while "done" not in d and time.monotonic() < deadline:
                time.sleep(0.01)
            rows.append({"http_in": d["arrive"] - t0, "to_core_and_scheduled": d["sched"] - d["arrive"],
                         "prefill_and_sample": d["token"] - d["sched"], "hand_back": d["back"] - d["token"],
                         "detok_and_push": d["done"] - d["back"], "sse_out": t1 - d["done"], "client_ttft": t1 - t0,
                         "offline_prefill": offline(r.prompt_ids)})
            print(len(r.prompt_ids), {k: round(v * 1e3, 1) for k, v in rows[-1].items()}, flush=True)
        for name, f in (("median", statistics.median), ("mean", statistics.fmean)):
            print(name, "ms:", {k: round(f(r[k] for r in rows) * 1e3, 2) for k in rows[0]})
        t0 = time.monotonic()
        for r in reqs:
            apply_chat_template(eng.tokenizer, [{"role": "user", "content": eng.tokenizer.decode(r.prompt_ids)}])
        print(f"chat template + tokenizing: {(time.monotonic() - t0) / len(reqs) * 1e3:.2f} ms per prompt")
    finally:
        srv.should_exit = True
        time.sleep(1)
        eng.shutdown()


if __name__ == "__main__":  # the core process is spawned: it imports this file and must not run main
    main()
