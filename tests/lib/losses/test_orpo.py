"""ORPO equals the paper's formula (Hong et al. 2024), written out here on random log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.losses.orpo import log_odds, orpo_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)
B = 11


def mean_logps(seed, dtype=torch.float64):
    """Per-token mean log-probs a (P = exp(a) from 0.02 to 0.97: both branches of log1mexp)."""
    g = torch.Generator().manual_seed(seed)
    a_c, a_r = (-0.03 - 4 * torch.rand(B, generator=g, dtype=dtype) for _ in range(2))
    return a_c.requires_grad_(), a_r.requires_grad_()


def paper(a_c, a_r, lam):
    """L_SFT + lambda L_OR with P = exp(a), odds = P / (1 - P) (eq. 1, 4, 6, 7)."""
    p_c, p_r = torch.exp(a_c), torch.exp(a_r)
    odds_c, odds_r = p_c / (1 - p_c), p_r / (1 - p_r)
    l_or = -torch.log(1 / (1 + 1 / (odds_c / odds_r)))          # -log s(log(odds_c / odds_r))
    l_sft = -a_c
    return (l_sft + lam * l_or).mean(), l_or, torch.log(odds_c / odds_r)


@pytest.mark.parametrize("lam", [0.1, 0.25, 1.0])
def test_loss_and_gradients_match_the_paper(lam):
    a_c, a_r = mean_logps(seed=1)
    assert (a_c > -math.log(2)).any() and (a_c < -math.log(2)).any()
    got, m = orpo_loss(a_c, a_r, odds_ratio_weight=lam, beta=0.2)
    want, l_or, ratio = paper(a_c, a_r, lam)
    torch.testing.assert_close(got, want, **TIGHT)
    for x, y in zip(torch.autograd.grad(got, [a_c, a_r]), torch.autograd.grad(want, [a_c, a_r])):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m["odds_ratio_loss"], l_or.detach().mean(), **TIGHT)
    torch.testing.assert_close(m["log_odds_ratio"], ratio.detach().mean(), **TIGHT)
    torch.testing.assert_close(m["nll_chosen"], -a_c.detach().mean(), **TIGHT)
    torch.testing.assert_close(m["rewards_rejected"], 0.2 * a_r.detach().mean(), **TIGHT)
    # the log odds rise with a: accuracy by log-probs is accuracy by odds
    assert m["accuracy"].item() == pytest.approx((ratio > 0).double().mean().item())


def test_fp32_and_stable_log_odds():
    a_c, a_r = mean_logps(seed=2, dtype=torch.float32)
    got, _ = orpo_loss(a_c, a_r, odds_ratio_weight=0.1)
    want, _, _ = paper(a_c.double(), a_r.double(), 0.1)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    # near P = 1 (a -> 0), where 1 - exp(a) in floats loses the digits, and far below it
    a = [-1e-9, -1e-4, -50.0]
    want = torch.tensor([x - math.log(-math.expm1(x)) for x in a], dtype=torch.float64)
    torch.testing.assert_close(log_odds(torch.tensor(a, dtype=torch.float64)), want, **TIGHT)


def test_bad_weight_is_rejected():
    a_c, a_r = mean_logps(seed=3)
    with pytest.raises(ValueError, match="odds_ratio_weight must be positive"):
        orpo_loss(a_c, a_r, odds_ratio_weight=0.0)
