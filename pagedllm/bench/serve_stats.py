"""Per-system serving figures from per-request records (``label``, ``ttft`` s, ``itl`` gaps s, ``tokens``,
``error``): completed count, output tok/s over the run's wall time, TTFT and inter-token p50/p99 (ms) for all,
short and long prompts, and the KV hand-over means when the engine's stats carry them. Shared by the in-process
serve bench and the HTTP one against vLLM's server."""

from __future__ import annotations

from pagedllm.bench.common import percentile


def summarize(results: list[dict], wall: float, stats: dict) -> dict:
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]

    def ms(xs, p):
        v = percentile(xs, p)
        return None if v is None else 1000 * v

    out = {"completed": len(ok), "failed": len(results) - len(ok), "errors": [r["error"] for r in results if r["error"]][:3], "wall_s": wall,
           "tok_s": sum(r["tokens"] for r in ok) / wall if wall else None,
           "hit_rate": stats.get("hit_rate"), "ttft_s": [r["ttft"] for r in ok]}
    for label in ("all", "short", "long"):
        sel = [r for r in ok if label in ("all", r["label"])]
        ttft = [r["ttft"] for r in sel]
        itl = [x for r in sel for x in r["itl"]]
        out[label] = {"n": len(sel), "ttft_p50": ms(ttft, 50), "ttft_p99": ms(ttft, 99), "itl_p50": ms(itl, 50),
                      "itl_p99": ms(itl, 99)}
    n_imp = stats.get("kv_transfer_imports", 0)
    if n_imp:
        out["transfer"] = {"handovers": n_imp, "blocks": stats["kv_transfer_blocks"],
                           "kib_per_handover": stats["kv_transfer_bytes"] / n_imp / 1024,
                           **{f"{k}_ms": 1000 * stats[f"kv_transfer_{k}_s"] / n_imp
                              for k in ("export", "transit", "queue", "import")}}
    return out
