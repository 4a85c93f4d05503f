import pytest

from pagedllm.attention import get_backend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass, greedy_generate
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.tiny import tiny_hf_model
from pagedllm.spec_decode import SpeculativeConfig, make_proposer
from pagedllm.spec_decode.draft_model import DraftModelProposer, self_speculative_draft

BS = 4


@pytest.fixture(scope="module")
def target():
    hf, cfg = tiny_hf_model("llama3", seed=3, vocab=64)
    m = LlamaForCausalLM(cfg)
    m.load_hf_state_dict(hf.state_dict())
    return m


def target_greedy(model, prompt, n):
    cfg = model.config
    runner = ForwardPass(model, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, BS),
                         get_backend("reference"))
    return greedy_generate(runner, [prompt], n)[0]


def test_all_layers_draft_proposes_the_targets_greedy_tokens(target):
    prompts = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    p = make_proposer(SpeculativeConfig.from_dict({"method": "draft_model", "num_layers": 2,
                                                   "num_speculative_tokens": 6, "draft_num_blocks": 16}),
                      target, get_backend("reference"))
    out = p.propose(prompts, [6, 3], ["a", "b"]).token_ids
    assert out == [target_greedy(target, prompts[0], 6), target_greedy(target, prompts[1], 3)]
    assert target.config.num_layers == 2 and len(target.layers) == 2  # the target is untouched


def test_fewer_layers_stays_in_step_after_rollback(target):
    draft = self_speculative_draft(target, 1)
    assert draft.layers[0].qkv_weight is target.layers[0].qkv_weight  # shared, not copied
    p = DraftModelProposer(draft, get_backend("reference"), num_blocks=12, block_size=BS)
    fresh = lambda: DraftModelProposer(draft, get_backend("reference"), num_blocks=12, block_size=BS)  # noqa: E731
    hist = [3, 1, 4, 1, 5, 9, 2]
    d1 = p.propose([hist], [4], ["r"]).token_ids[0]
    assert len(d1) == 4 and all(0 <= t < 64 for t in d1)
    # the verifier accepted 1 draft and corrected the next: the cache must roll back to hist + d1[0]
    hist2 = hist + [d1[0], (d1[1] + 1) % 64]
    d2 = p.propose([hist2], [4], ["r"]).token_ids[0]
    assert d2 == fresh().propose([hist2], [4], ["r"]).token_ids[0]
    assert p.seqs["r"].tokens == hist2 + d2[:3]
    assert len(p.seqs["r"].blocks) == -(-(len(hist2) + 3) // BS)
    # everything accepted plus a bonus: only the last draft and the bonus are new to the cache
    hist3 = hist2 + d2 + [7]
    d3 = p.propose([hist3], [2], ["r"]).token_ids[0]
    assert d3 == fresh().propose([hist3], [2], ["r"]).token_ids[0]
    p.finish_request("r")
    assert p.pool.num_free == 12 and not p.seqs


def test_pool_exhaustion_means_no_drafts_not_failure(target):
    p = DraftModelProposer(self_speculative_draft(target, 1), get_backend("reference"), num_blocks=3, block_size=BS)
    out = p.propose([[1] * 6, [2] * 6], [4, 4], ["a", "b"]).token_ids
    assert len(out[0]) == 4 and out[1] == []  # a: 9 slots = 3 blocks; b: none left
    assert p.pool.num_free == 0 and "b" in p.seqs and p.seqs["b"].blocks == []


def test_rejects_bad_layer_count(target):
    with pytest.raises(ValueError, match="num_layers"):
        self_speculative_draft(target, 3)
    with pytest.raises(ValueError, match="req_ids"):
        DraftModelProposer(target, get_backend("reference"), 4, BS).propose([[1]], [1])
