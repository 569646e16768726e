"""PPO's GAE, whitening, explained variance and clipped value loss equal their paper formulas,
written here independently (loops over rows and trained tokens); the policy loss with per-token
advantages equals the PPO clip token by token."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses.grpo import grpo_loss
from posttrain.losses.ppo import (explained_variance, gae, masked_moments, terminal_rewards,
                                  value_loss, whiten)

TIGHT = dict(rtol=1e-12, atol=1e-12)
B, T = 5, 9


def batch(seed=0):
    """values, per-sequence rewards, a mask with gaps (multi-turn: environment tokens are not
    trained) and an empty row; masked-out values are NaN."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :9] = True
    mask[1, :3] = True
    mask[2, [0, 1, 4, 5, 6]] = True       # two turns, environment tokens 2-3 between
    mask[3, [2, 7]] = True
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    values[~mask] = torch.nan
    rewards = torch.rand(B, generator=g, dtype=torch.float64)
    return values, rewards, mask               # row 4: no trained token


def reference_gae(values, rewards, mask, gamma, lam):
    """A_k = sum_l (gamma lam)^l delta_{k+l}, delta_k = r_k + gamma V_{k+1} - V_k over each row's
    trained tokens, the reward on the last one, V after the last = 0."""
    adv = torch.zeros(values.shape, dtype=torch.float64)
    ret = torch.zeros(values.shape, dtype=torch.float64)
    for b in range(values.shape[0]):
        pos = [t for t in range(values.shape[1]) if mask[b, t]]
        n = len(pos)
        v = [float(values[b, t]) for t in pos] + [0.0]
        r = [0.0] * (n - 1) + [float(rewards[b])] if n else []
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
        for k in range(n):
            a = sum((gamma * lam) ** l * delta[k + l] for l in range(n - k))
            adv[b, pos[k]] = a
            ret[b, pos[k]] = a + v[k]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.7), (1.0, 1.0), (0.99, 0.0)])
def test_gae_equals_the_sum_of_discounted_td_errors(gamma, lam):
    values, rewards, mask = batch()
    adv, ret = gae(values, terminal_rewards(rewards, mask), mask, gamma=gamma, lam=lam)
    want_adv, want_ret = reference_gae(values, rewards, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv, **TIGHT)
    torch.testing.assert_close(ret, want_ret, **TIGHT)
    if (gamma, lam) == (1.0, 1.0):           # Monte Carlo: every return is the reward
        torch.testing.assert_close(ret[mask], rewards[:, None].expand(B, T)[mask], **TIGHT)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_terminal_rewards_sit_on_each_rows_last_trained_token():
    _, rewards, mask = batch()
    r = terminal_rewards(rewards, mask)
    for b, last in enumerate([8, 2, 6, 7, None]):
        want = torch.zeros(T, dtype=torch.float64)
        if last is not None:
            want[last] = rewards[b]
        torch.testing.assert_close(r[b], want, **TIGHT)


def test_whitening_over_a_batch_split_in_parts_and_explained_variance():
    values, rewards, mask = batch(1)
    adv, ret = gae(values, terminal_rewards(rewards, mask), mask)
    x = adv[mask]
    want = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(whiten(adv, mask)[mask], want, **TIGHT)
    # moments are sums: two micro-batches (rows 0-1 and 2-4) whiten like the whole batch
    parts = [slice(0, 2), slice(2, B)]
    total = sum(masked_moments(adv[p], mask[p]) for p in parts)
    torch.testing.assert_close(torch.cat([whiten(adv[p], mask[p], total) for p in parts]),
                               whiten(adv, mask), **TIGHT)
    # 1 - Var(R - V) / Var(R), and R - V is the advantage
    r, v = ret[mask], values[mask]
    want_ev = 1 - (r - v).var() / r.var()
    got = explained_variance(masked_moments(ret, mask), masked_moments(ret - values, mask))
    assert abs(got - float(want_ev)) < 1e-12
    assert abs(got - explained_variance(masked_moments(ret, mask), masked_moments(adv, mask))) \
        < 1e-12


def reference_value_loss(v, old, ret, mask, clip, aggregation):
    rows = []
    for b in range(v.shape[0]):
        row = []
        for t in range(v.shape[1]):
            if mask[b, t]:
                loss = (v[b, t] - ret[b, t]) ** 2
                if clip is not None:
                    vc = old[b, t] + torch.clamp(v[b, t] - old[b, t], -clip, clip)
                    loss = torch.max(loss, (vc - ret[b, t]) ** 2)
                row.append(0.5 * loss)
        rows.append(row)
    seqs = [r for r in rows if r]
    if aggregation == "token_mean":
        tokens = [x for r in seqs for x in r]
        return sum(tokens) / len(tokens)
    return sum(sum(r) / len(r) for r in seqs) / len(seqs)


@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_clipped_value_loss_and_its_gradient(clip, aggregation):
    old, rewards, mask = batch(2)
    _, ret = gae(old, terminal_rewards(rewards, mask), mask)
    g = torch.Generator().manual_seed(3)
    v = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    loss, m = value_loss(v, old, ret, mask, clip=clip, aggregation=aggregation)
    want = reference_value_loss(v, old, ret, mask, clip, aggregation)
    torch.testing.assert_close(loss, want, **TIGHT)
    (grad,) = torch.autograd.grad(loss, v)
    (want_grad,) = torch.autograd.grad(want, v)
    torch.testing.assert_close(grad.where(mask, 0.0), want_grad.where(mask, 0.0), **TIGHT)
    assert not grad[~mask].any()
    if clip is not None:      # tokens whose clipped value is farther: no gradient, counted
        far = ((old + (v - old).clamp(-clip, clip) - ret) ** 2 > (v - ret) ** 2) & mask
        assert 0 < int(far.sum()) < int(mask.sum())
        assert not grad[far].any()
        assert abs(float(m["value_clip_fraction"]) - int(far.sum()) / int(mask.sum())) < 1e-12
    # global counts: a micro-batch's share of a bigger batch's loss
    n = int(mask.sum()) if aggregation == "token_mean" else 4
    key = "global_tokens" if aggregation == "token_mean" else "global_sequences"
    share, _ = value_loss(v, old, ret, mask, clip=clip, aggregation=aggregation,
                          **{key: 2 * n})
    torch.testing.assert_close(share, loss / 2, **TIGHT)


def test_policy_loss_with_per_token_advantages():
    """grpo_loss with [B, T] advantages is the PPO clip per token; a row-constant [B, T] is
    the [B] form."""
    g = torch.Generator().manual_seed(4)
    _, _, mask = batch()
    logp = (-3 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[~mask] = torch.nan
    loss, _ = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    terms = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                rho = torch.exp(logp[b, t] - old[b, t])
                terms.append(-torch.min(rho * adv[b, t],
                                        torch.clamp(rho, 0.8, 1.28) * adv[b, t]))
    torch.testing.assert_close(loss, sum(terms) / len(terms), **TIGHT)
    row = torch.randn(B, generator=g, dtype=torch.float64)
    a, _ = grpo_loss(logp, old, row, mask)
    b, _ = grpo_loss(logp, old, row[:, None].expand(B, T), mask)
    torch.testing.assert_close(a, b, **TIGHT)


def test_bad_arguments_are_refused():
    values, rewards, mask = batch()
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(values, terminal_rewards(rewards, mask), mask, lam=1.5)
    with pytest.raises(ValueError, match="rewards_B"):
        terminal_rewards(rewards[:2], mask)
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(values, values, values, mask, clip=0.0)
    with pytest.raises(ValueError, match="aggregation"):
        value_loss(values, values, values, mask, aggregation="mean")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        grpo_loss(values, values, rewards[:, None].expand(B, 2), mask)
