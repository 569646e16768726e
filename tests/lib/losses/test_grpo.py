"""GRPO, DAPO, Dr. GRPO and GSPO losses and the GRPO / RLOO / REINFORCE++ advantages equal their
paper formulas, written here independently (loops over samples and tokens); gradients too."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.losses.grpo import estimate_advantages, group_advantages, grpo_loss

TIGHT = dict(rtol=1e-12, atol=1e-12)
B, T = 6, 7
LENGTHS = [7, 3, 5, 1, 6, 4]  # response tokens per row, left-aligned


def batch(seed=0, dtype=torch.float64, spread=0.3):
    """logp (leaf), old, ref, engine log-probs, advantages, mask; masked positions hold NaN/inf."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp = -3 * torch.rand(B, T, generator=g, dtype=dtype)
    old = logp + spread * torch.randn(B, T, generator=g, dtype=dtype)
    ref = logp + spread * torch.randn(B, T, generator=g, dtype=dtype)
    engine = old + spread * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    for t in (logp, old, ref, engine):
        t[~mask] = torch.nan
    old[2, -1] = -torch.inf
    logp[1, -1] = torch.inf
    return logp.requires_grad_(), old, ref, engine, adv, mask


def reference(logp, old, adv, mask, *, clip_low=0.2, clip_high=0.28, ref=None, kl_coef=0.0,
              engine=None, is_cap=None, aggregation="token_mean", constant_norm=None):
    """Per-token loss from the definitions, then the paper's aggregation, in Python loops."""
    rows, tokens = [], []
    for b in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            rho = torch.exp(logp[b, t] - old[b, t])
            clipped = torch.clamp(rho, 1 - clip_low, 1 + clip_high)
            pg = -torch.min(rho * adv[b], clipped * adv[b])
            if engine is not None:
                w = torch.exp(old[b, t] - engine[b, t])
                if is_cap is not None:
                    w = torch.clamp(w, max=is_cap)
                pg = w * pg
            if ref is not None:
                d = ref[b, t] - logp[b, t]
                pg = pg + kl_coef * (torch.exp(d) - d - 1)
            row.append(pg)
        rows.append(row)
        tokens += row
    seqs = [r for r in rows if r]
    if aggregation == "token_mean":
        return sum(tokens) / len(tokens)
    if aggregation == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in seqs) / len(seqs)
    c = constant_norm if constant_norm is not None else logp.shape[1]
    return sum(sum(r) / c for r in seqs) / len(seqs)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------------------------- advantages

def test_advantages_with_and_without_std():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5, 8, generator=g, dtype=torch.float64)
    centered = r - r.mean(1, keepdim=True)
    std = torch.sqrt(((r - r.mean(1, keepdim=True)) ** 2).sum(1, keepdim=True) / (8 - 1))
    torch.testing.assert_close(group_advantages(r, normalize_std=False), centered, **TIGHT)
    torch.testing.assert_close(group_advantages(r), centered / (std + 1e-6), **TIGHT)
    torch.testing.assert_close(group_advantages(r, eps=0.5), centered / (std + 0.5), **TIGHT)
    # Each group sums to zero: the group mean is the baseline.
    torch.testing.assert_close(group_advantages(r).sum(1), torch.zeros(5, dtype=r.dtype),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_equal_rewards_give_exact_zero(normalize_std, eps):
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = group_advantages(r, normalize_std=normalize_std, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[[0, 1, 3]] == 0).all()
    assert (adv[2] != 0).all()


def test_binary_rewards_match_hand_computed():
    # One correct out of four: mean 1/4, sample std sqrt(1/4) = 1/2.
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_advantages(torch.rand(4, 1))
    with pytest.raises(ValueError, match=r"num_prompts, samples_per_prompt"):
        group_advantages(torch.rand(8))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def reference_advantages(r, estimator, eps=1e-6):
    """RLOO and REINFORCE++(-baseline) from their definitions, one sample at a time."""
    G, N = r.shape
    out = torch.zeros_like(r)
    for g in range(G):
        for i in range(N):
            others = [r[g, j] for j in range(N) if j != i]
            if estimator == "rloo":
                out[g, i] = r[g, i] - sum(others) / (N - 1)
            else:
                out[g, i] = r[g, i] - sum(r[g]) / N
    if estimator == "reinforce_pp":
        a = out.flatten()
        mean = sum(a) / len(a)
        std = math.sqrt(sum((x - mean) ** 2 for x in a) / (len(a) - 1))
        out = (out - mean) / (std + eps)
        for g in range(G):
            if bool((r[g] == r[g, 0]).all()):
                out[g] = 0.0
    return out


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_rloo_and_reinforce_pp_match_their_definitions(estimator):
    g = torch.Generator().manual_seed(3)
    r = torch.rand(5, 6, generator=g, dtype=torch.float64)
    r[2] = 0.5                                   # a group without signal
    got = estimate_advantages(r, estimator)
    torch.testing.assert_close(got, reference_advantages(r, estimator), rtol=0, atol=1e-12)
    assert (got[2] == 0).all()
    if estimator == "rloo":                      # N/(N-1) times the group-centered reward
        torch.testing.assert_close(got, group_advantages(r, normalize_std=False) * 6 / 5,
                                   rtol=0, atol=1e-12)
    else:                                        # normalized over the batch, not per group
        live = torch.cat([got[:2], got[3:]]).flatten()
        assert abs(float(got.flatten().mean())) < 1e-12
        assert float(got.flatten().std()) == pytest.approx(1.0, abs=1e-5)
        assert float(live.abs().max()) > 0


def test_group_norm_estimator_is_grpo_and_dr_grpo():
    r = torch.rand(4, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert torch.equal(estimate_advantages(r), group_advantages(r))
    assert torch.equal(estimate_advantages(r, normalize_std=False),
                       group_advantages(r, normalize_std=False))
    with pytest.raises(ValueError, match="rloo, reinforce_pp"):
        estimate_advantages(r, "gae_typo")


# ------------------------------------------------------------------------- loss vs reference

CASES = [
    dict(),
    dict(aggregation="seq_mean_token_mean"),
    dict(aggregation="constant"),
    dict(aggregation="constant", constant_norm=16.0),
    dict(clip_low=0.1, clip_high=0.1),
    dict(kl_coef=0.05, use_ref=True),
    dict(use_engine=True),
    dict(use_engine=True, is_cap=1.1),
    dict(aggregation="seq_mean_token_mean", kl_coef=0.1, use_ref=True, use_engine=True,
         is_cap=2.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         or "default")
def test_loss_and_grads_match_reference(case):
    case = dict(case)
    use_ref, use_engine = case.pop("use_ref", False), case.pop("use_engine", False)
    logp, old, ref, engine, adv, mask = batch(seed=1)
    kw = dict(case, ref=ref if use_ref else None, engine=engine if use_engine else None)
    want = reference(logp, old, adv, mask, **kw)
    kw["ref_logp_BT"], kw["engine_logp_BT"] = kw.pop("ref"), kw.pop("engine")
    got, metrics = grpo_loss(logp, old, adv, mask, **kw)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, **TIGHT)
    g_got, g_want = grad_of(got, logp), grad_of(want, logp)
    assert torch.isfinite(g_got).all()
    assert (g_got[~mask] == 0).all()
    torch.testing.assert_close(g_got, g_want, **TIGHT)
    assert set(metrics) >= {"clip_fraction_low", "clip_fraction_high", "ratio_mean", "ratio_max"}
    assert ("kl" in metrics) == use_ref
    assert ("is_weight_mean" in metrics) == use_engine
    assert all(not v.requires_grad and torch.isfinite(v) for v in metrics.values())


def reference_gspo(logp, old, adv, mask, *, clip_low, clip_high):
    """GSPO's sequence objective (Zheng et al. 2025, eq. 5-7), negated: one length-normalized
    ratio per response, clipped as a whole, averaged over responses."""
    terms = []
    for b in range(logp.shape[0]):
        ts = [t for t in range(logp.shape[1]) if mask[b, t]]
        if not ts:
            continue
        s = torch.exp(sum(logp[b, t] - old[b, t] for t in ts) / len(ts))
        terms.append(-torch.min(s * adv[b], torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv[b]))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28), (0.5, 5.0)])
def test_gspo_sequence_ratio_matches_the_sequence_objective(clip):
    """Value and gradient of GSPO's objective, on responses far enough off-policy that some are
    clipped whole (narrow range) and some are not (wide range)."""
    clip_low, clip_high = clip
    logp, old, _, _, adv, mask = batch(seed=5, spread=0.05)
    want = reference_gspo(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high)
    got, m = grpo_loss(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high,
                       aggregation="seq_mean_token_mean", ratio="sequence")
    torch.testing.assert_close(got, want, **TIGHT)
    g_got, g_want = grad_of(got, logp), grad_of(want, logp)
    assert (g_got[~mask] == 0).all()
    torch.testing.assert_close(g_got, g_want, **TIGHT)
    # every token of a response carries the response's ratio
    s_B = torch.stack([torch.exp(((logp - old).where(mask, 0.0)[b].sum()) / mask[b].sum())
                       for b in range(B)]).detach()
    assert float(m["ratio_max"]) == pytest.approx(float(s_B.max()), rel=1e-12)
    if clip_low < 1e-3:              # the narrow range clips whole responses, or none of them
        clipped = (g_got.abs().sum(dim=1) == 0) & (adv != 0)
        assert 0 < int(clipped.sum()) < B


def test_gspo_is_the_token_ratio_on_policy():
    """On-policy (old = logp) both ratios are 1: the same loss and gradient."""
    logp, _, _, _, adv, mask = batch(seed=6)
    old = logp.detach().clone()
    tok, _ = grpo_loss(logp, old, adv, mask, aggregation="seq_mean_token_mean")
    seq, _ = grpo_loss(logp, old, adv, mask, aggregation="seq_mean_token_mean", ratio="sequence")
    torch.testing.assert_close(seq, tok, **TIGHT)
    torch.testing.assert_close(grad_of(seq, logp), grad_of(tok, logp), **TIGHT)


def test_aggregations_weight_tokens_as_the_papers_say():
    """Unit per-token losses: token_mean and seq_mean give 1, constant gives mean(n_b) / C."""
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp = torch.zeros(B, T, dtype=torch.float64)
    adv = -torch.ones(B, dtype=torch.float64)  # rho = 1: per-token loss = -A = 1
    for agg, want in [("token_mean", 1.0), ("seq_mean_token_mean", 1.0),
                      ("constant", sum(LENGTHS) / B / T)]:
        got, _ = grpo_loss(logp, logp, adv, mask, aggregation=agg)
        assert got.item() == pytest.approx(want, rel=1e-12)


def test_clip_higher_counts_are_asymmetric():
    rho = torch.tensor([0.70, 0.79, 0.81, 1.0, 1.21, 1.27, 1.29, 1.5], dtype=torch.float64)
    logp = rho.log()[None, :].repeat(2, 1).requires_grad_()
    old = torch.zeros_like(logp)
    mask = torch.ones(2, 8, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A > 0 row: clipped (zero gradient) only above 1.28: 1.29 and 1.5. A < 0 row: only below
    # 0.8: 0.70 and 0.79. 1.21 and 1.27 would be clipped with symmetric 0.2 but are not here.
    assert m["clip_fraction_high"].item() == pytest.approx(2 / 16)
    assert m["clip_fraction_low"].item() == pytest.approx(2 / 16)
    g = grad_of(loss, logp)
    assert (g[0] == 0).tolist() == [False] * 6 + [True] * 2
    assert (g[1] == 0).tolist() == [True] * 2 + [False] * 6
    # Beyond the clip on the other side the unclipped term is the min, so gradient flows:
    # the PPO objective is pessimistic.
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_mean"].item() == pytest.approx(rho.mean().item())
    _, sym = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert sym["clip_fraction_high"].item() == pytest.approx(4 / 16)


def test_kl_k3_matches_reference_and_is_nonnegative():
    logp, _, ref, _, adv, mask = batch(seed=2, spread=1.5)
    old = logp.detach()
    _, m = grpo_loss(logp, old, adv, mask, ref_logp_BT=ref)
    d = (ref - logp.detach())[mask]
    k3 = torch.exp(d) - d - 1
    assert (k3 >= 0).all()
    torch.testing.assert_close(m["kl"], k3.mean(), **TIGHT)
    # The KL term alone (A = 0): loss = kl_coef * token-mean k3, gradient kl_coef (1 - e^d) / N.
    loss, _ = grpo_loss(logp, old, torch.zeros_like(adv), mask, ref_logp_BT=ref, kl_coef=0.3)
    torch.testing.assert_close(loss, 0.3 * k3.mean(), **TIGHT)
    want = torch.zeros(B, T, dtype=torch.float64)
    want[mask] = 0.3 * (1 - torch.exp(d)) / mask.sum()
    torch.testing.assert_close(grad_of(loss, logp), want, **TIGHT)
    # k3 is 0 (and so is the metric) at logp == ref.
    _, m0 = grpo_loss(logp, old, adv, mask, ref_logp_BT=logp.detach())
    assert m0["kl"].item() == 0.0


def test_truncated_importance_weights():
    logp, _, _, engine, adv, mask = batch(seed=3, spread=0.5)
    old = logp.detach()
    cap = 1.2
    w = torch.exp(old - engine).clamp(max=cap)
    loss, m = grpo_loss(logp, old, adv, mask, engine_logp_BT=engine, is_cap=cap)
    # On-policy w.r.t. the trainer (rho = 1): loss = token-mean of -w A.
    want = (-(w * adv[:, None]))[mask].mean()
    torch.testing.assert_close(loss, want, **TIGHT)
    torch.testing.assert_close(m["is_weight_mean"], w[mask].mean(), **TIGHT)
    frac = (torch.exp(old - engine)[mask] >= cap).double().mean()
    assert 0 < frac < 1
    torch.testing.assert_close(m["is_truncated_fraction"], frac, **TIGHT)
    assert w[mask].max() <= cap
    # The weight is a constant: no gradient reaches the engine or old log-probs.
    engine_leaf = engine.clone().requires_grad_()
    loss, _ = grpo_loss(logp, old, adv, mask, engine_logp_BT=engine_leaf, is_cap=cap)
    loss.backward()
    assert engine_leaf.grad is None


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_on_policy_gradient_is_policy_gradient(aggregation):
    """rho = 1: d loss / d logp_bt = -A_b * (aggregation weight of token b, t)."""
    logp, _, _, _, adv, mask = batch(seed=4)
    loss, m = grpo_loss(logp, logp.detach(), adv, mask, aggregation=aggregation)
    m64 = mask.double()
    weight = {"token_mean": m64 / m64.sum(),
              "seq_mean_token_mean": m64 / m64.sum(1, keepdim=True) / B,
              "constant": m64 / (B * T)}[aggregation]
    torch.testing.assert_close(grad_of(loss, logp), -adv[:, None] * weight, **TIGHT)
    assert m["ratio_mean"].item() == 1.0
    assert m["clip_fraction_low"].item() == m["clip_fraction_high"].item() == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_micro_batches_with_global_counts_equal_the_full_batch(aggregation):
    logp, old, ref, engine, adv, mask = batch(seed=5)
    kw = dict(ref_logp_BT=ref, kl_coef=0.1, engine_logp_BT=engine, is_cap=2.0,
              aggregation=aggregation)
    if aggregation == "constant":
        kw["constant_norm"] = float(T)
    full, _ = grpo_loss(logp, old, adv, mask, **kw)
    g_full = grad_of(full, logp)
    if aggregation == "token_mean":
        kw["global_tokens"] = int(mask.sum())
    else:
        kw["global_sequences"] = int(mask.any(1).sum())
    total = 0
    for rows in ([0, 1], [2], [3, 4, 5]):
        total = total + grpo_loss(logp[rows], old[rows], adv[rows], mask[rows],
                                  **{k: (v[rows] if torch.is_tensor(v) else v)
                                     for k, v in kw.items()})[0]
    torch.testing.assert_close(total, full, **TIGHT)
    torch.testing.assert_close(grad_of(total, logp), g_full, **TIGHT)


def test_micro_batches_without_global_count_differ():
    """The reason for global_tokens: per-micro-batch token means over-weight short micro-batches."""
    logp, old, _, _, adv, mask = batch(seed=5)
    full, _ = grpo_loss(logp, old, adv, mask)
    halves = sum(grpo_loss(logp[r], old[r], adv[r], mask[r])[0] / 2 for r in ([0, 1, 2], [3, 4, 5]))
    assert not math.isclose(full.item(), halves.item(), rel_tol=1e-6)


def test_empty_mask_gives_zero_loss_and_grad():
    logp, old, _, _, adv, _ = batch(seed=6)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for agg in ("token_mean", "seq_mean_token_mean", "constant"):
        loss, m = grpo_loss(logp, old, adv, mask, aggregation=agg)
        assert loss.item() == 0.0
        assert (grad_of(loss, logp) == 0).all()
        assert all(torch.isfinite(v) for v in m.values())


def test_low_precision_inputs_compute_in_fp32():
    logp, old, _, _, adv, mask = batch(seed=7)
    lp = logp.detach().bfloat16().requires_grad_()
    loss, _ = grpo_loss(lp, old.bfloat16(), adv.bfloat16(), mask)
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad).all()


def test_bad_arguments_are_named():
    logp, old, ref, engine, adv, mask = batch()
    cases = [
        (dict(kl_coef=0.1), "ref_logp_BT"),
        (dict(is_cap=2.0), "engine_logp_BT"),
        (dict(engine_logp_BT=engine, is_cap=0.0), "is_cap"),
        (dict(aggregation="sum"), "aggregation"),
        (dict(constant_norm=8.0), "constant_norm"),
        (dict(aggregation="constant", constant_norm=0.0), "constant_norm"),
        (dict(aggregation="constant", global_tokens=10), "global_tokens"),
        (dict(global_sequences=3), "global_sequences"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(ref_logp_BT=ref[:, :3]), "ref_logp_BT"),
        (dict(ratio="response"), "ratio"),
        (dict(ratio="sequence", held_BT=mask), "context parallelism"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            grpo_loss(logp, old, adv, mask, **kw)
    with pytest.raises(ValueError, match="advantages_B"):
        grpo_loss(logp, old, adv[:3], mask)
