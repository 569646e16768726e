"""KTO equals the paper's formula (Ethayarajh et al. 2024), written out here on random
log-probs, with the reference point defined as `posttrain.losses.kto` documents it."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses.kto import kl_reference_point, kto_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)
S = 13


def completions(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    policy = (-5 - 20 * torch.rand(S, generator=g, dtype=dtype)).requires_grad_()
    ref = policy.detach() + torch.randn(S, generator=g, dtype=dtype)
    desirable = torch.rand(S, generator=g) < 0.6
    return policy, ref, desirable


def paper(policy, ref, desirable, z, beta, lam_d, lam_u):
    """E[lambda_y - v(x, y)], v = lambda_D s(beta (r - z)) or lambda_U s(beta (z - r))."""
    sig = lambda x: 1 / (1 + torch.exp(-x))
    total = 0
    for p, q, good in zip(policy, ref, desirable.tolist()):
        r = p - q
        total = total + (lam_d - lam_d * sig(beta * (r - z)) if good
                         else lam_u - lam_u * sig(beta * (z - r)))
    return total / len(policy)


def z_of_previous_step(policy_prev, ref_prev):
    """The reference point as documented: max(0, mean of the last step's log-ratios)."""
    return max(0.0, (policy_prev - ref_prev).mean().item())


@pytest.mark.parametrize("beta,lam_d,lam_u", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (1.0, 0.8, 1.0)])
def test_loss_and_gradients_match_the_paper(beta, lam_d, lam_u):
    policy, ref, desirable = completions(seed=1)
    prev_policy, prev_ref, _ = completions(seed=2)
    prev_policy = prev_policy.detach() + 0.5                  # a positive mean log-ratio
    z = kl_reference_point((prev_policy - prev_ref).mean().item())
    assert z == z_of_previous_step(prev_policy, prev_ref) > 0
    got, m = kto_loss(policy, ref, desirable, z, beta=beta, desirable_weight=lam_d,
                      undesirable_weight=lam_u)
    want = paper(policy, ref, desirable, z, beta, lam_d, lam_u)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(torch.autograd.grad(got, policy)[0],
                               torch.autograd.grad(want, policy)[0], **TIGHT)
    r = (policy - ref).detach()
    torch.testing.assert_close(m["rewards_desirable"], beta * r[desirable].mean(), **TIGHT)
    torch.testing.assert_close(m["rewards_undesirable"], beta * r[~desirable].mean(), **TIGHT)
    torch.testing.assert_close(m["log_ratio"], r.mean(), **TIGHT)
    assert m["kl"].item() == z
    assert (m["num_desirable"].item(), m["num_undesirable"].item()) == \
        (desirable.sum().item(), (~desirable).sum().item())
    right = torch.where(desirable, r > z, r < z)
    assert m["accuracy"].item() == pytest.approx(right.double().mean().item())


def test_reference_point_is_clamped_and_first_step_is_half():
    assert kl_reference_point(-0.3) == 0.0 and kl_reference_point(0.25) == 0.25
    policy, _, desirable = completions(seed=3, dtype=torch.float32)
    # policy = reference, z = 0: every completion sits at s(0), loss lambda_y / 2
    loss, m = kto_loss(policy, policy.detach().clone(), desirable, 0.0, beta=0.1,
                       desirable_weight=1.0, undesirable_weight=3.0)
    n_d = desirable.sum().item()
    assert loss.item() == pytest.approx((0.5 * n_d + 1.5 * (S - n_d)) / S, abs=1e-7)
    assert m["accuracy"].item() == 0 and m["log_ratio"].item() == 0


def test_fp32_sum_reduction_and_no_gradient_to_the_reference():
    policy, ref, desirable = completions(seed=4, dtype=torch.float32)
    ref = ref.clone().requires_grad_()
    total, _ = kto_loss(policy, ref, desirable, 0.2, beta=0.3, reduction="sum")
    want = paper(policy.double(), ref.double(), desirable, 0.2, 0.3, 1.0, 1.0) * S
    torch.testing.assert_close(total, want.float(), rtol=1e-6, atol=1e-6)
    total.backward()
    assert ref.grad is None and policy.grad is not None


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta=0.0), "beta must be positive"),
    (dict(undesirable_weight=0.0), "must be positive"),
    (dict(kl_reference=-0.1), "kl_reference must be >= 0"),
])
def test_bad_options_are_rejected(kwargs, match):
    policy, ref, desirable = completions(seed=5)
    args = {"beta": 0.1, "kl_reference": 0.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        kto_loss(policy, ref, desirable, args.pop("kl_reference"), **args)
