"""SimPO equals the paper's formula (Meng et al. 2024), written out here on random log-probs."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses.simpo import simpo_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)
B = 11


def mean_logps(seed, dtype=torch.float64):
    """Per-token mean log-probs of chosen and rejected responses (negative, a few nats)."""
    g = torch.Generator().manual_seed(seed)
    a_c, a_r = (-0.2 - 3 * torch.rand(B, generator=g, dtype=dtype) for _ in range(2))
    return a_c.requires_grad_(), a_r.requires_grad_()


def paper(a_c, a_r, beta, gamma, eps):
    """-log s(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma), label-smoothed as cDPO;
    gamma = gamma_beta_ratio * beta."""
    logit = beta * a_c - beta * a_r - gamma
    sig = lambda x: 1 / (1 + torch.exp(-x))
    return (-(1 - eps) * torch.log(sig(logit)) - eps * torch.log(sig(-logit))).mean()


@pytest.mark.parametrize("beta,ratio,eps", [(2.0, 0.5, 0.0), (10.0, 0.3, 0.0), (2.5, 0.0, 0.1),
                                            (0.5, 1.6, 0.0)])
def test_loss_and_gradients_match_the_paper(beta, ratio, eps):
    a_c, a_r = mean_logps(seed=1)
    got, m = simpo_loss(a_c, a_r, beta=beta, gamma_beta_ratio=ratio, label_smoothing=eps)
    want = paper(a_c, a_r, beta, ratio * beta, eps)
    torch.testing.assert_close(got, want, **TIGHT)
    for x, y in zip(torch.autograd.grad(got, [a_c, a_r]), torch.autograd.grad(want, [a_c, a_r])):
        torch.testing.assert_close(x, y, **TIGHT)
    # the reference-free implicit rewards beta * a, their margins and the accuracy
    torch.testing.assert_close(m["rewards_chosen"], beta * a_c.detach().mean(), **TIGHT)
    torch.testing.assert_close(m["margins"], beta * (a_c - a_r).detach().mean(), **TIGHT)
    assert m["accuracy"].item() == pytest.approx((a_c > a_r).double().mean().item())


def test_fp32_and_sum_reduction():
    a_c, a_r = mean_logps(seed=2, dtype=torch.float32)
    got, _ = simpo_loss(a_c, a_r, beta=2.0, gamma_beta_ratio=0.5)
    torch.testing.assert_close(got, paper(a_c.double(), a_r.double(), 2.0, 1.0, 0.0).float(),
                               rtol=1e-6, atol=1e-6)
    total, _ = simpo_loss(a_c, a_r, beta=2.0, gamma_beta_ratio=0.5, reduction="sum")
    torch.testing.assert_close(total, got * B, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta=0.0), "beta must be positive"),
    (dict(gamma_beta_ratio=-0.1), "gamma_beta_ratio must be >= 0"),
    (dict(label_smoothing=0.6), r"label_smoothing must be in \[0, 0.5\]"),
])
def test_bad_options_are_rejected(kwargs, match):
    a_c, a_r = mean_logps(seed=3)
    with pytest.raises(ValueError, match=match):
        simpo_loss(a_c, a_r, **{"beta": 2.0, **kwargs})
