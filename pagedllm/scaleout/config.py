"""How a scaled-out engine is laid out: replicas, their roles, the Ray cluster, the routing."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.args import EngineArgs
from pagedllm.kv.prefix_cache import HASH_KEY_ENV  # replicas sharing prefix KV must hash blocks with one key
from pagedllm.scaleout.router import POLICIES

__all__ = ["HASH_KEY_ENV", "ScaleOutConfig", "parse_disaggregate", "wants_scaleout"]


def parse_disaggregate(spec: str) -> tuple[int, int]:
    """``"prefill=P,decode=D"`` -> (P, D); ValueError naming the field otherwise."""
    counts: dict[str, int] = {}
    for part in spec.split(","):
        key, _, value = part.strip().partition("=")
        if key not in ("prefill", "decode") or not value.strip().isdigit() or key in counts:
            raise ValueError(f"disaggregate: expected 'prefill=P,decode=D', got {spec!r}")
        counts[key] = int(value)
    if set(counts) != {"prefill", "decode"} or min(counts.values()) < 1:
        raise ValueError(f"disaggregate: expected 'prefill=P,decode=D' with P, D >= 1, got {spec!r}")
    return counts["prefill"], counts["decode"]


@dataclass
class ScaleOutConfig:
    num_replicas: int = 2  # colocated replicas (each prefills and decodes)
    num_prefill: int = 0  # > 0: disaggregated, this many prefill replicas ...
    num_decode: int = 0  # ... and this many decode replicas (num_replicas is ignored)
    ray_address: str | None = None  # None: start a local Ray instance (unless one is running)
    routing: str = "prefix"  # prefix | least-loaded
    num_cpus_per_replica: float = 1.0
    max_restarts: int = 4  # a replica that dies is restarted by Ray this many times
    balance_threshold: int = 8  # in-flight requests a prefix holder may lead the least loaded by
    min_fetch_blocks: int = 2  # fetch a peer's prefix blocks when at least this many

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if (self.num_prefill > 0) != (self.num_decode > 0) or min(self.num_prefill, self.num_decode) < 0:
            raise ValueError("num_prefill and num_decode must both be >= 1 (disaggregated) or both 0")
        if not self.disaggregated and self.num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.num_replicas}")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def size(self) -> int:
        return self.num_prefill + self.num_decode if self.disaggregated else self.num_replicas

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **overrides) -> ScaleOutConfig:
        p, d = parse_disaggregate(args.disaggregate) if args.disaggregate else (0, 0)
        return cls(num_replicas=args.data_parallel_size, num_prefill=p, num_decode=d, ray_address=args.ray_address,
                   **overrides)


def wants_scaleout(args: EngineArgs) -> bool:
    """More than one engine replica asked for (``--data-parallel-size`` > 1 or ``--disaggregate``);
    ValueError naming the field for settings that contradict each other or would be ignored."""
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    if args.disaggregate and args.data_parallel_size > 1:
        raise ValueError("data_parallel_size: with --disaggregate the replicas are counted by prefill=P,decode=D")
    wanted = args.data_parallel_size > 1 or bool(args.disaggregate)
    if args.ray_address and not wanted:
        raise ValueError("ray_address: only used with --data-parallel-size > 1 or --disaggregate")
    if wanted and args.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size: each replica runs one worker in its own process (KV blocks move "
                         "between replicas from that worker's pool): not combined with scale-out yet")
    return wanted
