"""A rank that dies or stops answering stops the others with a clear error within the group's timeout: never
a hang."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from pagedllm.distributed.launcher import TPLaunchError, run_tensor_parallel
from pagedllm.distributed.parallel_state import TPError, init_tp_group

TIMEOUT_S = 5.0


def die_or_reduce(tp, stall_s: float) -> None:
    """Rank 1 is killed (``stall_s`` 0) or stalls ``stall_s`` seconds; rank 0 all-reduces and says how long its
    failed collective took."""
    if tp.rank == 1:
        if not stall_s:
            os.kill(os.getpid(), 9)
        time.sleep(stall_s)
    start = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except TPError as e:
        raise RuntimeError(f"failed after {time.monotonic() - start:.1f} s") from e


@pytest.mark.parametrize("stall_s", [0, 2 * TIMEOUT_S], ids=["killed", "stalled"])
def test_a_lost_rank_stops_the_others_with_a_clear_error(stall_s):
    with pytest.raises(TPLaunchError) as err:
        run_tensor_parallel(die_or_reduce, 2, (stall_s,), timeout_s=TIMEOUT_S)
    msg = str(err.value)
    assert "rank 0 raised" in msg and "TPError: tensor-parallel all_reduce failed on rank 0 of 2" in msg
    if stall_s:
        assert "rank 1 raised" in msg  # it woke up to a group that had gone
    else:
        assert "rank 1 died (exit code -9)" in msg
    if stall_s:  # rank 0 gave up at the group's timeout, before the stalled rank 1 woke up
        assert float(re.search(r"failed after ([0-9.]+) s", msg).group(1)) < stall_s


def test_bad_group_arguments_name_the_field():
    with pytest.raises(ValueError, match="rank"):
        init_tp_group(2, 2)
    with pytest.raises(ValueError, match="world_size"):
        init_tp_group(0, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        init_tp_group(0, 1, timeout_s=0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        run_tensor_parallel(die_or_reduce, 2, threads_per_rank=0)
