"""Allowed ids: log-probs over a restricted head equal the renormalised softmax formula, the
gradient reaches only the allowed rows, and bad ranges or tokens are refused."""

from __future__ import annotations

import pytest
import torch

from posttrain.ops.cross_entropy import chunked_logprobs
from posttrain.ops.vocab import (check_token_ranges, renumber_tokens, restrict_head,
                                 sample_next_token, token_range_ids)

N, HIDDEN, PADDED, REAL = 29, 16, 64, 50
RANGES = ((3, 20), (20, 31), (47, 50))          # adjacent windows, and one at the end


@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (4.0, 0.7)])
def test_restricted_logprobs_equal_the_renormalised_softmax(softcap, temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, HIDDEN, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(PADDED, HIDDEN, generator=g)).requires_grad_()
    bias = (0.5 * torch.randn(PADDED, generator=g)).requires_grad_()
    allowed = [i for lo, hi in RANGES for i in range(lo, hi)]
    tokens = torch.tensor(allowed)[torch.randint(0, len(allowed), (N,), generator=g)]
    tokens[::5] = -100
    w, b, renumbered = restrict_head(weight, bias, tokens, RANGES)
    got = chunked_logprobs(hidden, w, renumbered, real_vocab_size=w.shape[0], chunk_tokens=7,
                           softcap=softcap, bias=b, temperature=temperature)
    # reference: the full logits, the allowed columns' log-sum-exp
    z = hidden @ weight.T + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lse = torch.logsumexp(z[:, allowed], dim=-1)
    kept = tokens != -100
    want = torch.where(kept, z.gather(1, tokens.clamp_min(0)[:, None])[:, 0] - lse, 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    grad_got = torch.autograd.grad(got.sum(), [hidden, weight, bias])
    grad_want = torch.autograd.grad(want.sum(), [hidden, weight, bias])
    for a, b_ in zip(grad_got, grad_want):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-6)
    outside = torch.ones(PADDED, dtype=torch.bool)
    outside[allowed] = False
    assert grad_got[1][outside].abs().max() == 0 and grad_got[2][outside].abs().max() == 0


def test_a_sampler_over_the_restricted_head_draws_allowed_ids_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(256, REAL, generator=g) * 3
    logits[:, 0] = 50.0                                    # the favourite is not allowed
    ids_A = token_range_ids(RANGES)
    drawn = ids_A[sample_next_token(logits[:, ids_A], 1.0, generator=g)]
    assert set(drawn.tolist()) <= set(ids_A.tolist()) and len(set(drawn.tolist())) > 10


def test_bad_ranges_and_tokens_are_refused():
    assert check_token_ranges([[3, 5], (5, 9)]) == ((3, 5), (5, 9))
    assert check_token_ranges(()) == ()
    for bad, match in [([(5, 3)], "0 <= lo < hi"), ([(0, 60)], "<= 50"),
                       ([(3, 9), (8, 12)], "disjoint"), ([(1.5, 3)], "two integers")]:
        with pytest.raises(ValueError, match=match):
            check_token_ranges(bad, vocab_size=REAL)
    assert renumber_tokens(torch.tensor([3, -100, 48]), RANGES, REAL).tolist() == [0, -100, 29]
    with pytest.raises(ValueError, match=r"tokens \[35\] are outside the allowed ids"):
        renumber_tokens(torch.tensor([3, 35]), RANGES, REAL)
