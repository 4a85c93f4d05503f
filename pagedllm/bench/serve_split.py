"""Where a first token's time goes, from the servers' own ``/metrics``: both ours and vLLM's report
``vllm:time_to_first_token_seconds`` (server arrival -> first token), ``vllm:request_queue_time_seconds``
(arrival -> first scheduled) and ``vllm:request_prefill_time_seconds`` (first scheduled -> first token) under
the same names. Scraped before and after a rate, the histograms' sums give each part's mean over that rate's
requests; the client's mean TTFT minus the server's is what neither histogram sees (HTTP, parsing and
tokenizing before the server's arrival stamp, the hand-back of the first token, detokenizing, SSE framing)."""

from __future__ import annotations

PARTS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
         "prefill": "vllm:request_prefill_time_seconds"}


def scrape(base_url: str) -> dict[str, float]:
    """``{part}_sum`` / ``{part}_count`` of each histogram in ``PARTS`` (summed over label sets); a family the
    server does not report is absent."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    names = {f"{name}_{kind}": f"{part}_{kind}" for part, name in PARTS.items() for kind in ("sum", "count")}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] = out.get(names[s.name], 0.0) + s.value
    return out


def split(before: dict[str, float], after: dict[str, float], client_ttft_s: list[float]) -> dict[str, float | None]:
    """Mean ms of each part over the requests between two scrapes, ``outside``: the client's mean TTFT minus the
    server's, and ``before_core``: the server's TTFT less queue and prefill (None where a histogram is missing or
    counted no request)."""
    def mean_ms(part: str) -> float | None:
        n = after.get(f"{part}_count", 0.0) - before.get(f"{part}_count", 0.0)
        if f"{part}_sum" not in after or n <= 0:
            return None
        return 1000 * (after[f"{part}_sum"] - before.get(f"{part}_sum", 0.0)) / n

    out = {part: mean_ms(part) for part in PARTS}
    client = 1000 * sum(client_ttft_s) / len(client_ttft_s) if client_ttft_s else None
    out["client"] = client
    out["outside"] = None if client is None or out["ttft"] is None else client - out["ttft"]
    # the server's own TTFT beyond queue + prefill: the time before its core took the request in (vLLM stamps
    # its queue start there; ours stamps it at the front end's arrival, so ours is ~0)
    parts = (out["ttft"], out["queue"], out["prefill"])
    out["before_core"] = None if None in parts else parts[0] - parts[1] - parts[2]
    return out
