"""vLLM's own clients against `pagedllm serve` (the embedded model, started with a `vllm serve` line):

1. `vllm bench serve`, its chat and completions backends: each run's client TTFT is compared with our server's
   /metrics TTFT histogram over the same requests (they must agree within 10%: the chat role chunk goes out
   with the first token);
2. its KV event decoder (`msgspec.msgpack.Decoder(KVEventBatch)`, scripts/vllm_kv_events_decode.py) on the
   events our server published meanwhile (`--kv-events-config`): it must decode every batch, and the cached
   set it rebuilds must equal the one our own decoder rebuilds.

vLLM is not in CI (its install takes half an hour): `bash scripts/setup_baselines.sh vllm` installs it into
/opt/vllm-venv ($PAGEDLLM_VLLM_VENV); this script is run by hand and its figures go into bench/README.md.

    python scripts/vllm_clients_check.py [--prompts 8] [--input-len 192] [--output-len 16] [--out bench/vllm_clients_check.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from kv_replay import replay_all
from load_test import wait_healthy
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.kv.kv_events import decode_batch

BACKENDS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
MODEL_NAME = "smollm2"
TOLERANCE = 0.10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of our vllm:time_to_first_token_seconds histogram."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name.startswith("vllm:time_to_first_token_seconds_")}
    return got["vllm:time_to_first_token_seconds_sum"], got["vllm:time_to_first_token_seconds_count"]


def vllm_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)  # vLLM's venv must not see our tree
    return env


def our_cached_set(replay: str) -> set[bytes]:
    """The cached block hashes our own decoder rebuilds from every batch the replay socket resends."""
    cached: set[bytes] = set()
    for payload in replay_all(replay):
        for ev in decode_batch(payload)[1]:
            if ev["type"] == "BlockStored":
                cached |= set(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                cached -= set(ev["block_hashes"])
            else:
                cached.clear()
    return cached


def check_kv_events(venv: Path, replay: str) -> dict:
    """vLLM's decoder and ours on the same published batches."""
    cmd = [str(venv / "bin" / "python"), str(Path(__file__).parent / "vllm_kv_events_decode.py"), replay]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, check=False, env=vllm_env(), text=True, capture_output=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"vLLM's decoder failed on our KV events:\n{r.stderr[-3000:]}")
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = sorted(h.hex() for h in our_cached_set(replay))
    return {"batches": theirs["batches"], "events": theirs["events"], "cached_blocks": len(ours),
            "same_cached_set": theirs["cached"] == ours}


def run_vllm_bench(vllm: Path, backend: str, url: str, tokenizer: str, args: argparse.Namespace, seed: int,
                   result_dir: str) -> dict:
    """One `vllm bench serve` run, one request at a time; returns its result JSON."""
    name = f"{backend}.json"
    cmd = [str(vllm), "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", BACKENDS[backend],
           "--model", MODEL_NAME, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.prompts), "--max-concurrency", "1", "--ignore-eos", "--seed", str(seed),
           # its ready check sends the first prompt once more, which would then be a prefix-cache hit
           "--ready-check-timeout-sec", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", result_dir, "--result-filename", name, "--disable-tqdm"]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, check=False, env=vllm_env(), text=True, capture_output=True, timeout=1800)
    print(r.stdout[-2500:], r.stderr[-1500:] if r.returncode else "", flush=True)
    if r.returncode:
        raise SystemExit(f"vllm bench serve --backend {backend} failed ({r.returncode})")
    return json.loads((Path(result_dir) / name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--out", default="bench/vllm_clients_check.json")
    args = p.parse_args()
    venv = Path(os.environ.get("PAGEDLLM_VLLM_VENV", "/opt/vllm-venv"))
    vllm = venv / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"{vllm} is missing: bash scripts/setup_baselines.sh vllm")

    from pagedllm.models.loader import resolve_model_dir

    tokenizer = resolve_model_dir()  # the embedded GGUF's HF directory (tokenizer files included)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = tempfile.TemporaryDirectory()
    replay = f"ipc://{tmp.name}/kv-replay"
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp.name}/kv",
                 "replay_endpoint": replay}
    # a usual `vllm serve` line, run unchanged
    serve = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
             "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--gpu-memory-utilization", "0.9",
             "--disable-log-requests", "--uvicorn-log-level", "warning", "--kv-events-config", json.dumps(kv_events)]
    print("$", " ".join(serve), flush=True)
    proc = subprocess.Popen(serve, start_new_session=True)
    rows = []
    try:
        wait_healthy(url, proc, timeout=600)
        # warm-up, not measured: the first request pays for lazy initialisation
        httpx.post(f"{url}/v1/completions", timeout=600,
                   json={"model": MODEL_NAME, "prompt": "Warm up.", "max_tokens": 4}).raise_for_status()
        for seed, backend in enumerate(BACKENDS, start=1):  # a seed each: no prompt repeats across runs
            before = server_ttft(url)
            res = run_vllm_bench(vllm, backend, url, tokenizer, args, seed, tmp.name)
            after = server_ttft(url)
            n = after[1] - before[1]
            server_ms = 1000 * (after[0] - before[0]) / n
            client_ms = res["mean_ttft_ms"]
            rows.append({"backend": backend, "endpoint": BACKENDS[backend], "completed": res["completed"],
                         "failed": res.get("failed", args.prompts - res["completed"]),
                         "server_requests": n, "client_mean_ttft_ms": client_ms,
                         "server_mean_ttft_ms": server_ms, "ratio": client_ms / server_ms,
                         "client_p99_itl_ms": res.get("p99_itl_ms"),
                         "client_mean_tpot_ms": res.get("mean_tpot_ms"),
                         "output_throughput": res.get("output_throughput")})
        kv = check_kv_events(venv, replay)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        rc = 128 - rc if rc < 0 else rc  # as a shell reports it: 143 = ended by the SIGTERM it was sent
        tmp.cleanup()
    load = os.getloadavg()
    summary = {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
               "max_concurrency": 1, "server_exit_code_after_sigterm": rc, "load": load, "rows": rows,
               "kv_events_decoded_by_vllm": kv}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print("\n| backend | completed / failed | vllm bench mean TTFT (ms) | our /metrics mean TTFT (ms) | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} ({r['endpoint']}) | {r['completed']} / {r['failed']} | "
              f"{r['client_mean_ttft_ms']:.1f} | {r['server_mean_ttft_ms']:.1f} | {r['ratio']:.3f} |")
    print(f"\nKV events, decoded by vLLM's KVEventBatch decoder: {kv}")
    print(f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; pagedllm serve exit code after SIGTERM: {rc}")
    bad = [r for r in rows if r["failed"] or r["completed"] < args.prompts or abs(r["ratio"] - 1) > TOLERANCE]
    sys.exit(1 if bad or not kv["same_cached_set"] or not kv["cached_blocks"] else 0)


if __name__ == "__main__":
    main()
