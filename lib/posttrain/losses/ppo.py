"""PPO's critic side: generalized advantage estimation, whitening, the clipped value loss.

The policy's loss is `posttrain.losses.grpo.grpo_loss` (the PPO clip, Schulman et al. 2017,
"Proximal Policy Optimization Algorithms") with one advantage per token from here, instead of
one per response from a group of samples.

GAE (`gae`; Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation"). A response is a trajectory whose actions are its trained tokens: for
row b, the positions t_1 < ... < t_n where the loss mask is set (a multi-turn episode's
environment tokens are not actions: they are skipped, and the state of the next action holds
them). With V_k the critic's value of the state before action k (the hidden state at the
position that predicts token t_k) and r_k the reward of action k:

    delta_k = r_k + gamma V_{k+1} - V_k                 V_{n+1} = 0: the episode ends
    A_k     = sum_{l >= 0} (gamma lam)^l delta_{k+l}  = delta_k + gamma lam A_{k+1}
    R_k     = A_k + V_k                                 the lambda-return, the value target

The reward is sparse (`terminal_rewards`): the response's scalar reward on its last trained
token, 0 on the others. lam = 1 gives A_k = (sum of later rewards) - V_k (Monte Carlo with a
baseline), lam = 0 the one-step TD error. A truncated response (max_new_tokens) is treated as
ended, as RLHF implementations do.

Whitening (`whiten`; Ouyang et al. 2022 and Huang et al. 2024, "The N Implementation Details of
RLHF with PPO", which follow the OpenAI lm-human-preferences code): the advantages of the
whole step's batch (every trained token of every sequence, over all mini-batches and
data-parallel ranks: `masked_moments` are sums, so ranks add them up) are shifted and scaled,

    A' = (A - mean(A)) / sqrt(var(A) + eps)            var with Bessel's correction

The value targets R stay unwhitened.

Value loss (`value_loss`; the PPO2 baselines code, as in those papers): with V the critic's
value now, V_old its value when the batch was scored (before this step's updates) and
eps_v = `clip`,

    L_t = 1/2 max( (V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps_v, eps_v) - R_t)^2 )

aggregated over the mask like `grpo_loss` (token_mean, seq_mean_token_mean, constant, with the
step's global counts). The clip keeps the value near the one the advantages were computed with;
``clip=None`` is the plain squared error. A value-loss coefficient (PPO's c_1) is left out: the
critic is a model of its own with its own optimizer, and Adam does not see a constant factor.

Explained variance (`explained_variance`): 1 - Var(R - V_old) / Var(R) over the batch's
trained tokens, from moments: 1 when the critic predicts the returns, 0 when it is no better
than their mean, negative when worse.
"""

from __future__ import annotations

import torch

from posttrain.losses.grpo import Aggregation, _aggregate, _check_aggregation, _wide

__all__ = ["explained_variance", "gae", "masked_moments", "terminal_rewards", "value_loss",
           "whiten"]


def terminal_rewards(rewards_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T]: each row's scalar reward on its last trained token (the last
    position of `mask_BT`), 0 elsewhere. A row without trained tokens gets none."""
    mask = mask_BT.bool()
    if rewards_B.shape != mask.shape[:1]:
        raise ValueError(f"rewards_B must be [B] = [{mask.shape[0]}], got shape "
                         f"{tuple(rewards_B.shape)}")
    T = mask.shape[1]
    last_B = torch.where(mask, torch.arange(T, device=mask.device), -1).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=_wide(rewards_B).dtype, device=mask.device)
    rows = last_B >= 0
    out[rows.nonzero().squeeze(1), last_B[rows]] = _wide(rewards_B)[rows]
    return out


@torch.no_grad()
def gae(values_BT: torch.Tensor, rewards_BT: torch.Tensor, mask_BT: torch.Tensor, *,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) by GAE over each row's trained tokens (module
    docstring), 0 off the mask. `values_BT` and `rewards_BT` are read on the mask only (masked
    out positions may hold anything, NaN included); computed in at least fp32, no gradient."""
    mask = mask_BT.bool()
    for name, t in (("values_BT", values_BT), ("rewards_BT", rewards_BT)):
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, mask_BT {tuple(mask.shape)}; "
                             "they must match")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.promote_types(_wide(values_BT).dtype, _wide(rewards_BT).dtype)
    v_BT = values_BT.to(dtype).where(mask, 0.0)
    r_BT = rewards_BT.to(dtype).where(mask, 0.0)
    adv_BT = torch.zeros_like(v_BT)
    next_value_B = v_BT.new_zeros(v_BT.shape[0])      # V_{k+1} of the next trained token
    next_adv_B = v_BT.new_zeros(v_BT.shape[0])        # A_{k+1}
    for t in reversed(range(v_BT.shape[1])):
        m_B = mask[:, t]
        delta_B = r_BT[:, t] + gamma * next_value_B - v_BT[:, t]
        a_B = delta_B + gamma * lam * next_adv_B
        adv_BT[:, t] = a_B.where(m_B, 0.0)
        next_value_B = v_BT[:, t].where(m_B, next_value_B)
        next_adv_B = a_B.where(m_B, next_adv_B)
    return adv_BT, (adv_BT + v_BT).where(mask, 0.0)


def masked_moments(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of `x_BT` over the mask, fp64: sums, so that the moments of a
    batch split over micro-batches and ranks add up (`whiten`, `explained_variance`)."""
    x = x_BT.to(torch.float64).where(mask_BT.bool(), 0.0)
    return torch.stack([mask_BT.bool().sum().to(torch.float64), x.sum(), x.square().sum()])


def _mean_var(moments: torch.Tensor) -> tuple[float, float]:
    """Mean and variance (Bessel's correction) from `masked_moments`."""
    n, s, ss = (float(v) for v in moments)
    if n < 1:
        return 0.0, 0.0
    mean = s / n
    return mean, max(ss - n * mean * mean, 0.0) / max(n - 1.0, 1.0)


def whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, moments: torch.Tensor | None = None, *,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on the mask, 0 off it (module docstring); `moments` are the
    whole batch's `masked_moments` (default: this tensor's)."""
    mean, var = _mean_var(masked_moments(x_BT, mask_BT) if moments is None else moments)
    x = _wide(x_BT)
    return ((x - mean) / (var + eps) ** 0.5).where(mask_BT.bool(), 0.0)


def explained_variance(returns_moments: torch.Tensor, errors_moments: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R), from the `masked_moments` of the returns R and of the errors
    R - V over the same tokens; 0 when the returns do not vary."""
    _, var_r = _mean_var(returns_moments)
    _, var_e = _mean_var(errors_moments)
    return 1.0 - var_e / var_r if var_r > 0 else 0.0


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, *, clip: float | None = 0.2,
               aggregation: Aggregation = "token_mean", constant_norm: float | None = None,
               global_tokens: int | None = None, global_sequences: int | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss (module docstring) over B responses, one per row.

    Args:
        values_BT: the critic's values (differentiable); masked-out positions may hold anything.
        old_values_BT: the values the advantages were computed with (detached).
        returns_BT: the value targets R (`gae`).
        mask_BT: the trained tokens.
        clip: eps_v, in the reward's units; None: no clipping.
        aggregation, constant_norm, global_tokens, global_sequences: as `grpo_loss`'s.

    Returns:
        (loss, metrics): metrics are detached token means: ``value_loss`` (the per-token loss),
        ``value_clip_fraction`` (tokens whose clipped term is the larger, so the clip zeroes
        their gradient), ``value_mean``, ``value_abs_error`` (|V - R|).
    """
    for name, t in (("old_values_BT", old_values_BT), ("returns_BT", returns_BT),
                    ("mask_BT", mask_BT)):
        if t.shape != values_BT.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, values_BT "
                             f"{tuple(values_BT.shape)}; they must match")
    if values_BT.dim() != 2:
        raise ValueError(f"values_BT must be [B, T], got shape {tuple(values_BT.shape)}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 (or None: no value clipping), got {clip}")
    _check_aggregation(aggregation, constant_norm, global_tokens, global_sequences)
    m_BT = mask_BT.bool()
    v = _wide(values_BT).where(m_BT, 0.0)
    old = _wide(old_values_BT).detach().to(v.dtype).where(m_BT, 0.0)
    ret = _wide(returns_BT).detach().to(v.dtype).where(m_BT, 0.0)
    unclipped_BT = (v - ret).square()
    loss_BT = unclipped_BT
    clipped_more_BT = torch.zeros_like(m_BT)
    if clip is not None:
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped_BT = (v_clipped - ret).square()
        loss_BT = torch.maximum(unclipped_BT, clipped_BT)
        clipped_more_BT = clipped_BT > unclipped_BT
    loss_BT = (0.5 * loss_BT).where(m_BT, 0.0)
    loss = _aggregate(loss_BT, m_BT, aggregation, constant_norm, global_tokens, global_sequences)
    with torch.no_grad():
        n = m_BT.sum().clamp(min=1)

        def token_mean(x_BT: torch.Tensor) -> torch.Tensor:
            return x_BT.to(v.dtype).where(m_BT, 0.0).sum() / n

        metrics = {"value_loss": token_mean(loss_BT),
                   "value_clip_fraction": token_mean(clipped_more_BT),
                   "value_mean": token_mean(v), "value_abs_error": token_mean((v - ret).abs())}
    return loss, metrics
