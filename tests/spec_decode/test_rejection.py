import pytest
import torch

from pagedllm.spec_decode.rejection import greedy_verify, pad_flat, rejection_sample, verify

V = 8
N = 20_000


def one_hot_probs(ids, vocab=V):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_matching_prefix_plus_bonus():
    target = torch.stack([one_hot_probs([3, 5, 1, 2]), one_hot_probs([3, 5, 1, 2]), one_hot_probs([4, 4, 4, 4])])
    drafts = torch.tensor([[3, 5, 1], [3, 6, 1], [0, 0, 0]])
    assert greedy_verify(target, drafts, torch.tensor([3, 3, 3])) == [[3, 5, 1, 2], [3, 5], [4]]
    # fewer drafts than K: the bonus comes from the row after the last real draft
    assert greedy_verify(target[:1], drafts[:1], torch.tensor([1])) == [[3, 5]]
    assert greedy_verify(target[:1], drafts[:1], torch.tensor([0])) == [[3]]


def test_pad_flat_and_shapes_checked():
    flat = torch.arange(10.0).view(5, 2)
    padded = pad_flat(flat, [2, 3])
    assert padded.shape == (2, 3, 2) and padded[0, 2].tolist() == [0, 0] and padded[1, 2].tolist() == [8, 9]
    with pytest.raises(ValueError, match="counts"):
        pad_flat(flat, [2, 2])
    with pytest.raises(ValueError, match="draft_ids"):
        greedy_verify(torch.zeros(1, 3, V), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sample(torch.zeros(1, 3, V), torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]))


def _distributions(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # target rows 0..2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # draft rows 0..1
    return p, q


def _tv(samples, probs):
    freq = torch.bincount(torch.tensor(samples), minlength=V).float() / len(samples)
    return 0.5 * (freq - probs).abs().sum().item()


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_preserves_the_target_distribution(with_q):
    torch.manual_seed(0)
    p, q = _distributions(1)
    assert 0.5 * (p[0] - q[0]).abs().sum() > 0.25  # a draft far from the target
    if with_q:
        d0 = torch.multinomial(q[0], N, replacement=True)
        d1 = torch.multinomial(q[1], N, replacement=True)
        draft_probs = q[None].expand(N, 2, V).contiguous()
    else:  # one-hot proposals: a fixed guess, as ngram/suffix make
        d0, d1 = torch.full((N,), int(p[0].argsort()[-2])), torch.full((N,), 2)  # the runner-up token
        draft_probs = None
    drafts = torch.stack([d0, d1], 1)
    target = p[None].expand(N, 3, V).contiguous()
    out = rejection_sample(target, drafts, torch.full((N,), 2), draft_probs)
    first = [o[0] for o in out]
    assert _tv(first, p[0]) < 0.015
    # the second token, where the first equals the draft the target's row 1 was conditioned on
    second = [o[1] for o, d in zip(out, d0.tolist()) if o[0] == d and len(o) > 1]
    assert len(second) > 1500 and _tv(second, p[1]) < 0.04
    # acceptance happens, and not always
    lengths = torch.tensor([len(o) for o in out]).float()
    assert 1.0 < lengths.mean() < 3.0 and int(lengths.max()) == 3


def test_seeded_rows_do_not_depend_on_the_batch():
    p, q = _distributions(2)
    target = p[None].expand(4, 3, V).contiguous()
    drafts = torch.tensor([[1, 2]] * 4)
    n = torch.tensor([2, 2, 2, 2])

    def run(seed_rows):
        gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seed_rows]
        return rejection_sample(target, drafts, n, None, gens)

    results = [run([7, 8, 9, 10]) for _ in range(2)]
    assert results[0] == results[1]
    mixed = [run([None, 8, None, 10]) for _ in range(5)]
    assert all(m[1] == results[0][1] and m[3] == results[0][3] for m in mixed)
    assert len({tuple(map(tuple, run([s] * 4))) for s in range(20)}) > 1  # the seed does matter


def test_mixed_batch_routes_rows():
    p, _ = _distributions(3)
    target = p[None].expand(3, 3, V).contiguous()
    best = p.argmax(-1)
    drafts = torch.stack([best[:2], best[:2], best[:2]])
    gens = [None, torch.Generator().manual_seed(1), None]
    out = verify(target, drafts, torch.tensor([2, 2, 1]), torch.tensor([True, False, True]), None, gens)
    assert out[0] == best.tolist() and out[2] == best[:2].tolist()
    alone = rejection_sample(target[1:2], drafts[1:2], torch.tensor([2]), None, [torch.Generator().manual_seed(1)])
    assert out[1] == alone[0]
