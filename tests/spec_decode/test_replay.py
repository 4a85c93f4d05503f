from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import Proposal, Proposer
from pagedllm.bench.spec_replay import replay_acceptance


class Oracle(Proposer):
    """Knows the outputs: drafts are always right, except one wrong token every ``miss`` tokens."""

    def __init__(self, prompts, outputs, miss=None):
        self.full = {f"replay-{i}": list(p) + list(o) for i, (p, o) in enumerate(zip(prompts, outputs))}
        self.miss = miss
        self.finished = []

    def propose(self, histories, num_tokens, req_ids=None):
        out = []
        for h, k, rid in zip(histories, num_tokens, req_ids):
            d = self.full[rid][len(h): len(h) + k]
            if self.miss and d:
                d[-1] = -5  # the last draft is always wrong
            out.append(d)
        return Proposal(out)

    def finish_request(self, req_id):
        self.finished.append(req_id)


def test_replay_counts_steps_like_speculative_decoding():
    prompts, outputs = [[1, 2], [3]], [list(range(10, 20)), list(range(30, 33))]
    perfect = Oracle(prompts, outputs)
    s = replay_acceptance(perfect, prompts, outputs, k=4)
    # seq 0: 10 tokens in steps of 5 (4 drafts + bonus) -> 2 steps; seq 1: 3 tokens, 2 drafts + bonus -> 1 step
    assert (s.num_tokens, s.num_steps, s.num_drafted, s.num_accepted) == (13, 3, 10, 10)
    assert sorted(perfect.finished) == ["replay-0", "replay-1"]
    lossy = replay_acceptance(Oracle(prompts, outputs, miss=True), prompts, outputs, k=4)
    # each step accepts all drafts but the last, which the target corrects:
    # seq 0 gains 4, 4, 1 (one wrong draft), 1 (no room for drafts); seq 1 gains 2, 1
    assert (lossy.num_steps, lossy.num_drafted, lossy.num_accepted) == (6, 4 + 4 + 1 + 2, 3 + 3 + 0 + 1)


def test_ngram_on_a_repeating_output():
    prompt = [7, 8, 9, 10, 11, 12]
    output = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12]
    s = replay_acceptance(NgramProposer(1, 3), [prompt], [output], k=4)
    # step 1: the prompt's last token never occurred before, no drafts; then 4 drafts + bonus twice; then 1 left
    assert (s.num_steps, s.num_drafted, s.num_accepted) == (4, 8, 8) and s.tokens_per_step == 3.0
