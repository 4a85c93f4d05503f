"""``AsyncEngine`` over several engine replicas on Ray: the same interface (``generate``,
``abort``, ``call``, ``stats``, ``check_integrity``, ``tokenizer``, ``limits``, ``model_name``,
``max_model_len``, ``error``), so the OpenAI server runs on it unchanged. Tokenization,
detokenization and stop strings stay here; replicas see token ids only.
"""

from __future__ import annotations

import asyncio
import threading

from pagedllm.config.args import EngineArgs
from pagedllm.frontend.async_engine import AsyncEngine
from pagedllm.protocol.limits import RequestLimits
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.models.loader import load_tokenizer
from pagedllm.scaleout.client import ReplicaSetClient
from pagedllm.scaleout.config import ScaleOutConfig

SAME = ("block_size", "kv_dtype", "kv_bytes_per_token")  # equal on every replica
AVERAGED = ("spec_acceptance_rate", "spec_mean_accepted_length")


class ScaleOutEngine(AsyncEngine):
    def __init__(self, args: EngineArgs, cfg: ScaleOutConfig | None = None) -> None:
        # AsyncEngine's state (its __init__ would build a core here), with the replica set as the core client
        self.args = args
        self.cfg = cfg or ScaleOutConfig.from_engine_args(args)
        self.tokenizer = load_tokenizer(args.model)
        self.processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()
        self._streams = {}
        self.client = ReplicaSetClient(args, self.cfg, self._on_outputs, self._on_error)
        spec = self.spec = self.client.spec
        self.limits = RequestLimits(spec.max_model_len, spec.num_blocks, spec.block_size, spec.vocab_size)
        self.model_name = spec.model_name
        self.max_model_len = spec.max_model_len

    async def stats(self) -> dict:
        """Every replica's pool stats summed (rates recomputed), plus each replica's own."""
        per = await asyncio.to_thread(self.client.stats)
        return aggregate_stats(per)

    async def check_integrity(self) -> None:
        """The pool check on every live replica (AssertionError names the replica)."""
        for i in range(len(self.client.replicas)):
            if i in self.client.router.down:
                continue
            try:
                await asyncio.wrap_future(self.client.call(_check, replica=i))
            except AssertionError as e:
                raise AssertionError(f"replica {i}: {e}") from e


def aggregate_stats(per: list[dict]) -> dict:
    """One snapshot for the whole set: counts and gauges summed, rates recomputed from the sums."""
    if not per:
        raise RuntimeError("no replica answered")
    total: dict = {}
    for k, v in per[0].items():
        if k == "replica":
            continue
        if k in SAME or isinstance(v, bool) or not isinstance(v, (int, float)):
            total[k] = v
        elif k in AVERAGED:
            total[k] = sum(s[k] for s in per) / len(per)
        else:
            total[k] = sum(s[k] for s in per)
    total["usage"] = total["used"] / total["num_blocks"]
    total["hit_rate"] = total["hit_tokens"] / total["query_tokens"] if total["query_tokens"] else 0.0
    total["request_hit_rate"] = total["hits"] / total["queries"] if total["queries"] else 0.0
    total["replicas"] = per
    return total


def _check(core) -> None:
    core.check_integrity()
