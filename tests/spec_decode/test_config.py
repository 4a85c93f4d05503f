import pytest

from pagedllm.spec_decode import SpeculativeConfig, make_proposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixProposer


def test_parses_vllm_dict_and_builds_the_proposer():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
                                       "prompt_lookup_min": 2})
    p = make_proposer(cfg)
    assert isinstance(p, NgramProposer) and (p.min_n, p.max_n) == (2, 5)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).lookup_range == (1, 4)
    assert isinstance(make_proposer(SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8})),
                      SuffixProposer)


@pytest.mark.parametrize("d, field", [
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "lookahead"),
    ({"num_speculative_tokens": 4}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 4}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "x.gguf"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 4, "model": "x", "num_layers": 2}, "num_layers"),
    ({"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 2.0},
     "suffix_decoding_min_token_prob"),
])
def test_bad_config_names_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)


def test_draft_model_needs_the_target():
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="target"):
        make_proposer(cfg)
