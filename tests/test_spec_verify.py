"""Speculative decoding's proposal and verification pieces (engine/spec): the n-gram proposer, greedy
verification (the target's own tokens), and rejection sampling whose output is distributed exactly as
the target's (a frequency test over many draws on a tiny vocabulary, with a stated tolerance)."""
from __future__ import annotations

import array

import pytest
import torch

from engine.spec.ngram import TokenBytes, ngram_propose
from engine.spec.verify import verify_greedy, verify_sampled


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert ngram_propose(tokens, 3, 1, 2) == [9, 2, 5]  # [5, 6] last occurred at 5..6, followed by 9, 2, 5
    assert ngram_propose(tokens, 1, 1, 4) == [9]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # 4 never occurred before
    assert ngram_propose([7, 7, 7], 5, 1, 2) == [7]  # only one token follows the match [7, 7] at 0
    assert ngram_propose([3, 1, 2, 9, 1, 2], 2, 2, 2) == [9, 1]
    assert ngram_propose([1], 3, 1, 2) == [] and ngram_propose([1, 2, 1], 0, 1, 2) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram_propose([1, 2], 2, 3, 2)


def test_ngram_skips_byte_matches_that_straddle_token_boundaries():
    # 256 = bytes 00 01 00 00, 1 = 01 00 00 00: [256, 0] holds the bytes of token 1 at offset 1
    tokens = [256, 0, 7, 1]
    assert ngram_propose(tokens, 2, 1, 1) == []
    assert ngram_propose([1, 9, 256, 0, 7, 1], 2, 1, 1) == [9, 256]


def test_ngram_on_a_long_context_finds_a_copied_span():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50_000, (4096,), generator=g).tolist()
    copied = prompt[1000:1010]
    assert ngram_propose(prompt + copied, 4, 2, 4) == prompt[1010:1014]


def test_a_request_s_token_bytes_grow_with_it_and_propose_what_a_fresh_conversion_does():
    """Prompt lookup keeps each request's tokens as int32 bytes and appends only the new ones: the
    proposals at every step equal those of a conversion of the whole list, and a list that is not the
    one it followed (shorter, or another token where it ended) is converted again."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (300,), generator=g).tolist()
    kept = TokenBytes()
    for end in range(2, len(tokens), 7):
        seen = tokens[:end]
        data = kept.update(seen)
        assert bytes(data) == array.array("i", seen).tobytes()
        assert ngram_propose(seen, 4, 1, 3, data) == ngram_propose(seen, 4, 1, 3)
    other = [99, 98, 97, 96, 99, 98]
    assert kept.update(other) == array.array("i", other).tobytes()   # shorter: another list
    longer = other[:-1] + [5, 99, 98]
    assert kept.update(longer) == array.array("i", longer).tobytes()  # its 6th token differs
    assert ngram_propose(longer, 2, 1, 2, kept.data) == [97, 96]


def test_greedy_accepts_the_prefix_equal_to_the_target_and_adds_its_next_token():
    argmax = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 2, 3, 8], [4, 5, 6, 7]])
    proposals = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 5, 6], [4, 5, 6]])
    out = verify_greedy(argmax, proposals, torch.tensor([3, 3, 3, 1]))
    assert out.num_tokens.tolist() == [4, 2, 1, 2]
    assert out.tokens.tolist() == [[4, 5, 6, 7], [4, 9, -1, -1], [1, -1, -1, -1], [4, 5, -1, -1]]


def _distributions(g, batch, rows, vocab):
    return torch.softmax(torch.randn(batch, rows, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1)


@pytest.mark.parametrize("draft", [True, False], ids=["draft-model", "n-gram"])
def test_rejection_sampling_draws_exactly_from_the_target(draft):
    """Target rows p_0..p_K fixed per position (so position j's token is distributed as p_j whatever
    came before); proposals drawn from the draft q (or fixed tokens, one-hot q). Over N = 200,000 draws
    the frequencies of the first token, and of the second among draws that have one, are within
    0.006 of p_0 and p_1 (a frequency's standard deviation is at most 0.0011 here: over 5 sigma)."""
    g = torch.Generator().manual_seed(1)
    n, k, vocab = 200_000, 3, 6
    p = _distributions(g, 1, k + 1, vocab)[0]
    target = p.expand(n, k + 1, vocab)
    if draft:
        q = _distributions(g, 1, k, vocab)[0]
        proposals = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
        draft_probs = q.expand(n, k, vocab)
    else:
        proposals = torch.tensor([2, 0, 5]).expand(n, k)
        draft_probs = None
    out = verify_sampled(target, proposals, torch.full((n,), k), torch.rand(n, k, generator=g, dtype=torch.float64),
                         torch.rand(n, generator=g, dtype=torch.float64), draft_probs)
    first = torch.bincount(out.tokens[:, 0], minlength=vocab).double() / n
    assert (first - p[0]).abs().max() < 0.006, (first, p[0])
    two = out.num_tokens >= 2
    second = torch.bincount(out.tokens[two, 1], minlength=vocab).double() / two.sum()
    assert two.sum() > 20_000 and (second - p[1]).abs().max() < 0.006 + 0.02 * (two.sum() < 50_000)
    assert ((out.tokens >= 0).sum(dim=1) == out.num_tokens).all()


def test_sampling_with_no_proposals_draws_the_target_and_a_certain_proposal_is_always_kept():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]], dtype=torch.float64)
    out = verify_sampled(p, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.999]], dtype=torch.float64),
                         torch.tensor([0.6], dtype=torch.float64))
    assert out.tokens.tolist() == [[1, 2]] and out.num_tokens.tolist() == [2]  # p(1) = 1: kept; then 0.6 -> 2
    out = verify_sampled(p, torch.tensor([[0]]), torch.tensor([0]), torch.tensor([[0.0]], dtype=torch.float64),
                         torch.tensor([0.3], dtype=torch.float64))
    assert out.tokens.tolist() == [[1, -1]] and out.num_tokens.tolist() == [1]  # no proposal: one draw of p_0
