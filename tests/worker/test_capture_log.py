"""Start-up logs how long the decode graphs took to capture (on the CPU with a capture stand-in that runs the step)."""

from __future__ import annotations

import logging
import re

from pagedllm import LLM
from pagedllm.worker import cuda_graphs


class RunOnce:
    def capture(self, step):
        step()
        return step


def test_capture_time_is_logged(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(cuda_graphs, "graph_capture", lambda device: RunOnce())
    with caplog.at_level(logging.INFO, logger="pagedllm.worker"):
        LLM(tiny_model_dir, device="cpu", attention_backend="cpu", num_blocks=16, max_num_seqs=16)
    assert re.search(r"decode graphs: 5 batch sizes \(up to 16\) captured in \d+\.\d s", caplog.text), caplog.text
