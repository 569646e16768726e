"""Bradley-Terry reward loss equals -log sigmoid(r_c - r_r - m); its metrics are right."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.losses.reward import bt_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)


def rewards(seed=0, n=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rc, rr = (3 * torch.randn(n, generator=g, dtype=dtype) for _ in range(2))
    margin = torch.rand(n, generator=g, dtype=dtype)
    return rc.requires_grad_(), rr.requires_grad_(), margin


@pytest.mark.parametrize("with_margin", [False, True])
def test_loss_and_grads_match_formula(with_margin):
    rc, rr, margin = rewards(seed=1)
    m = margin if with_margin else torch.zeros_like(margin)
    got, _ = bt_loss(rc, rr, margin if with_margin else None)
    want = (-torch.log(1 / (1 + torch.exp(-(rc - rr - m))))).mean()
    torch.testing.assert_close(got, want, **TIGHT)
    for a, b in zip(torch.autograd.grad(got, [rc, rr]), torch.autograd.grad(want, [rc, rr])):
        torch.testing.assert_close(a, b, **TIGHT)


def test_fp32_sum_and_extreme_gaps_are_finite():
    rc = torch.tensor([200.0, -200.0, 0.0], requires_grad=True)
    rr = torch.zeros(3)
    loss, _ = bt_loss(rc, rr, reduction="sum")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor(200.0 + math.log(2.0)))
    (grad,) = torch.autograd.grad(loss, rc)
    torch.testing.assert_close(grad, torch.tensor([0.0, -1.0, -0.5]))


def test_metrics():
    rc = torch.tensor([1.0, 2.0, 0.5, 3.0])
    rr = torch.tensor([0.0, 2.5, 0.5, 1.0])
    _, metrics = bt_loss(rc, rr, torch.ones(4))
    assert metrics["accuracy"].item() == 0.5  # a tie counts as wrong
    assert metrics["margin"].item() == pytest.approx((1.0 - 0.5 + 0.0 + 2.0) / 4)


def test_equal_rewards_give_log_2_and_margin_gets_no_gradient():
    rc, _, margin = rewards(seed=2)
    margin.requires_grad_()
    loss, _ = bt_loss(rc, rc.detach().clone(), torch.zeros_like(margin).requires_grad_())
    torch.testing.assert_close(loss, torch.tensor(math.log(2.0), dtype=torch.float64), **TIGHT)
    loss, _ = bt_loss(rc, rc.detach() - 1, margin)
    loss.backward()
    assert margin.grad is None


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="must both be"):
        bt_loss(torch.zeros(3), torch.zeros(4))
