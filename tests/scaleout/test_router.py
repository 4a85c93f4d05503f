"""Prefix-aware routing with least-loaded fallback (no Ray needed)."""

from __future__ import annotations

import pytest

from pagedllm.scaleout.config import ScaleOutConfig, parse_disaggregate
from pagedllm.scaleout.router import PrefixRouter

BS = 4


def prompt(prefix: int, tail: int, n_prefix_blocks: int = 3) -> list[int]:
    return [prefix] * (n_prefix_blocks * BS) + [1000 + tail]


def test_shared_prefix_follows_its_replica_and_others_spread():
    r = PrefixRouter(3, BS)
    first = r.route(prompt(1, 0)).replica
    r.route(prompt(2, 0))  # another prefix: least loaded, not ``first``
    assert all(r.route(prompt(1, t)).replica == first for t in range(1, 4))
    assert r.load[first] == 4
    assert sorted(r.load) == [0, 1, 4]


def test_least_loaded_fallback_names_the_holder_to_fetch_from():
    r = PrefixRouter(2, BS, balance_threshold=1, min_fetch_blocks=2)
    owner = r.route(prompt(1, 0)).replica
    r.route(prompt(1, 1))
    assert r.load[owner] == 2  # within the threshold: affinity
    route = r.route(prompt(1, 2))  # owner leads by 2 > 1: the other replica, fetching 3 blocks
    assert route.replica != owner and route.fetch_from == owner and route.matched_blocks == 3
    short = PrefixRouter(2, BS, balance_threshold=0, min_fetch_blocks=4)
    o = short.route(prompt(1, 0)).replica
    assert short.route(prompt(1, 1)).fetch_from is None and short.load[o] == 1  # too short to be worth a fetch


def test_least_loaded_policy_ignores_prefixes_and_done_frees_load():
    r = PrefixRouter(2, BS, policy="least-loaded")
    picks = [r.route(prompt(1, t)).replica for t in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]
    r.done(picks[0])
    assert r.route(prompt(1, 9)).replica == picks[0]


def test_down_replicas_get_nothing_and_forget_clears_affinity():
    r = PrefixRouter(2, BS)
    owner = r.route(prompt(1, 0)).replica
    r.down.add(owner)
    assert r.route(prompt(1, 1)).replica == 1 - owner
    r.down.discard(owner)
    r.forget(1 - owner)
    r.done(owner)
    assert r.route(prompt(1, 2)).replica == owner  # only ``owner`` is still known to hold it
    r.down.update({0, 1})
    with pytest.raises(RuntimeError, match="no replica is up"):
        r.route(prompt(1, 3))


def test_short_prompts_and_salts_do_not_share():
    r = PrefixRouter(2, BS)
    assert r.hashes([5] * (BS - 1)) == []
    assert r.hashes(prompt(1, 0), "tenant-a") != r.hashes(prompt(1, 0), "tenant-b")


def test_config_validation_names_the_field():
    assert parse_disaggregate("prefill=1,decode=2") == (1, 2)
    for bad in ("prefill=1", "prefill=0,decode=1", "prefill=x,decode=1", "decode=1,decode=1", "p=1,d=1"):
        with pytest.raises(ValueError, match="disaggregate"):
            parse_disaggregate(bad)
    with pytest.raises(ValueError, match="routing"):
        ScaleOutConfig(routing="random")
    with pytest.raises(ValueError, match="data_parallel_size"):
        ScaleOutConfig(num_replicas=0)
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter(2, BS, policy="x")


def test_serve_flags_that_contradict_or_would_be_ignored_are_refused():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.config.args import EngineArgs
    from pagedllm.scaleout.config import wants_scaleout

    def args(*flags: str) -> EngineArgs:
        return EngineArgs.from_namespace(build_parser().parse_args(["serve", *flags]))

    assert not wants_scaleout(args())
    assert wants_scaleout(args("--data-parallel-size", "2", "--ray-address", "auto"))
    cfg = ScaleOutConfig.from_engine_args(args("--disaggregate", "prefill=1,decode=2"))
    assert (cfg.num_prefill, cfg.num_decode, cfg.size, cfg.disaggregated) == (1, 2, 3, True)
    for flags, field in ((["--data-parallel-size", "0"], "data_parallel_size"),
                         (["--ray-address", "auto"], "ray_address"),
                         (["--data-parallel-size", "2", "--disaggregate", "prefill=1,decode=1"], "data_parallel_size"),
                         (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "tensor_parallel_size")):
        with pytest.raises(ValueError, match=field):
            wants_scaleout(args(*flags))
