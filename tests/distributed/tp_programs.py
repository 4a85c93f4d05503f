"""What each tensor-parallel rank runs in the tests: load a model, shard it, greedy-decode through the
unchanged ForwardPass with a KV cache of this rank's KV heads. Module-level functions, so spawned ranks
(``run_tensor_parallel``) can unpickle them; ``python -m torch.distributed.run ... tp_programs.py`` runs
:func:`main` on ranks that ``torchrun`` launched (one per node in the two-node test).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from pagedllm.bench.tp_equivalence import Result, greedy
from pagedllm.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group_from_env
from pagedllm.models.sharding import shard_model
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.quant import load_blocks

def tiny_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Our model with these HF-named weights."""
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(state_dict)
    return model


@dataclass(frozen=True)
class TinySpec:
    """A tiny model for the ranks: its config, its HF-named weights (torch.save'd), optionally its matrices in
    GGUF blocks (``save_blocks``'d) and multiplied on int8 activations (gguf-a8: packed after sharding), and the
    attention backends to decode it with."""

    cfg: ModelConfig
    weights: str
    backends: tuple[str, ...]
    blocks: str | None = None
    int8_activations: bool = False


def tiny_rank(tp: TPGroup | None, specs: list[TinySpec], prompts: list[list[int]], n_new: int) -> list[Result]:
    """Every (model, backend) pair's greedy result on this rank's shard (``tp`` None: unsharded)."""
    out = []
    for spec in specs:
        model = tiny_model(spec.cfg, torch.load(spec.weights))
        if spec.blocks:
            model.use_gguf_blocks(load_blocks(spec.blocks))
        if tp is not None:
            shard_model(model, tp)
        if spec.int8_activations:
            model.pack_for_int8_activations()
        out.extend(greedy(model, prompts, n_new, b) for b in spec.backends)
    return out


def main() -> int:
    """torchrun entry: this rank's sharded tiny Qwen2 against TP=1 computed here; exit 0 when they agree."""
    from pagedllm.models.tiny import tiny_hf_model

    torch.set_num_threads(1)
    tp = init_tp_group_from_env(timeout_s=60)
    try:
        hf, cfg = tiny_hf_model("qwen2", vocab=512)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40)]
        want_ids, want_logits = greedy(tiny_model(cfg, hf.state_dict()), prompts, 6, "reference")
        got_ids, got_logits = greedy(shard_model(tiny_model(cfg, hf.state_dict()), tp), prompts, 6, "reference")
        err = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
        ok = got_ids == want_ids and err < 1e-4
        print(f"rank {tp.rank}/{tp.world_size}: tokens equal {got_ids == want_ids}, max logit error {err:.2e}",
              flush=True)
        return 0 if ok else 1
    finally:
        destroy_tp_group()


if __name__ == "__main__":
    sys.exit(main())
