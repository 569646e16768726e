"""Group-relative policy optimization (GRPO), its DAPO / Dr. GRPO / GSPO variants, and the
critic-free advantage estimators RLOO and REINFORCE++, per token.

Advantages (`estimate_advantages`, estimator by name). Each prompt g gets N sampled responses
with scalar rewards r_gi; every token of response i gets the advantage of its response:

    group_norm    A_gi = (r_gi - mean_j r_gj) / (std_j r_gj + eps)
                                  GRPO, Shao et al. 2024 (DeepSeekMath)
                  A_gi =  r_gi - mean_j r_gj               (normalize_std false)
                                  Dr. GRPO, Liu et al. 2025 (no std: dividing by it up-weights
                                  prompts that are too easy or too hard)
    rloo          A_gi = r_gi - 1/(N-1) sum_{j != i} r_gj  = N/(N-1) (r_gi - mean_j r_gj)
                                  REINFORCE leave-one-out, Kool et al. 2019 ("Buy 4 REINFORCE
                                  samples, get a baseline for free"), Ahmadian et al. 2024
                                  ("Back to basics"): each sample's baseline is the mean of the
                                  others, so it is independent of the sample (unbiased)
    reinforce_pp  a_gi = r_gi - mean_j r_gj,  A_gi = (a_gi - mean_B a) / (std_B a + eps)
                                  REINFORCE++ (Hu et al. 2025), its "baseline" form for
                                  groups: the group mean as baseline, then normalization over
                                  the whole step's batch B (all prompts' samples) instead of
                                  per group, which keeps prompts' relative scales

PPO's advantages (``gae``) are per token, from a learned critic: `posttrain.losses.ppo`;
`grpo_loss` takes them as [B, T].

std is the sample standard deviation (Bessel's correction, as ``torch.std``). A group whose
rewards are all equal carries no signal and gets advantages of exactly 0 under every estimator.
`normalize_std` applies to group_norm only. REINFORCE++'s token-level KL penalty in the reward
is `kl_coef` with a reference here, in the loss (as GRPO adds it).

Importance ratio (`ratio`). ``token`` (default, PPO/GRPO): rho_bt = pi(y_t)/pi_old(y_t).
``sequence`` (GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per
response, the geometric mean of its token ratios,

    s_b = exp( (1/n_b) sum_t m_bt (logp_bt - old_logp_bt) )

clipped as a whole, so a response is kept or dropped together. Written as GSPO-token:
rho_bt = sg[s_b] * pi(y_t) / sg[pi(y_t)], whose value is s_b on every token and whose gradient
is s_b * grad log pi(y_t); with ``seq_mean_token_mean`` aggregation and one advantage per
response, the loss and its gradient are GSPO's sequence objective exactly,
-(1/S) sum_b min(s_b A_b, clip(s_b, 1 - clip_low, 1 + clip_high) A_b). GSPO's clip range is
about three orders of magnitude narrower than GRPO's (the paper: 3e-4 / 4e-4), since s_b
averages the token log-ratios.

Per-token loss (`grpo_loss`). For response token t of row b, with log-probs under the policy
being trained (logp), under the policy that generated the batch as the trainer computes it
(old_logp), under the inference engine that sampled it (engine_logp) and under the frozen
reference (ref_logp):

    rho_bt  = exp(logp - old_logp)                                    (importance ratio)
    pg_bt   = -min(rho A_b, clip(rho, 1 - clip_low, 1 + clip_high) A_b)
                                          PPO clip (Schulman et al. 2017); clip_high > clip_low
                                          is DAPO's clip-higher (Yu et al. 2025): low-probability
                                          tokens with A > 0 may grow further, against entropy
                                          collapse
    w_bt    = min(exp(old_logp - engine_logp), is_cap)                (detached)
                                          truncated importance sampling (Yao et al. 2025, "Your
                                          efficient RL framework secretly brings you off-policy
                                          RL training"): corrects for the engine's sampling
                                          distribution differing from the trainer's numerics;
                                          truncation bounds the variance
    kl_bt   = exp(ref - logp) - (ref - logp) - 1
                                          k3 estimator of KL(pi || ref) (Schulman 2020,
                                          "Approximating KL divergence"): unbiased, always >= 0
    L_bt    = w_bt pg_bt + kl_coef kl_bt

The IS weight multiplies the policy-gradient term only; the KL term is a regularizer, as in
DeepSeekMath, where it is added to the loss instead of the reward.

Aggregation over the mask m_bt (1 on response tokens), with S the number of sequences (rows with
at least one response token) and n_b = sum_t m_bt:

    seq_mean_token_mean   (1/S) sum_b (1/n_b) sum_t m L          GRPO paper: every response
                                                                 weighs the same, so a token of
                                                                 a long response weighs less
    token_mean            (1/sum_bt m) sum_bt m L                DAPO: every token weighs the
                                                                 same
    constant              (1/S) sum_b (1/C) sum_t m L            Dr. GRPO: a constant C (the
                                                                 generation budget) replaces n_b,
                                                                 removing the length bias

Gradient accumulation and data parallelism: the normalizers above are computed from the tensors
given, i.e. per micro-batch. To get one big batch's gradient from summed micro-batch losses, pass
the step's totals over all micro-batches and ranks: ``global_tokens`` (sum of m) for token_mean,
``global_sequences`` (S) for the other two. With ``constant`` set ``constant_norm`` too: its
default, the padded row length T, changes from micro-batch to micro-batch.

On-policy (one update per batch, old_logp = logp.detach(), no KL, no IS) rho = 1 and the gradient
of the loss with respect to logp_bt is -A_b times the aggregation weight of token (b, t): the
REINFORCE policy gradient with a group baseline.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

__all__ = ["aggregation_weights", "estimate_advantages", "group_advantages", "grpo_loss",
           "grpo_token_objective", "head_gradients_in_forward"]

Aggregation = Literal["seq_mean_token_mean", "token_mean", "constant"]
Estimator = Literal["group_norm", "rloo", "reinforce_pp"]
Ratio = Literal["token", "sequence"]
ESTIMATORS = ("group_norm", "rloo", "reinforce_pp")


def estimate_advantages(rewards_G_N: torch.Tensor, estimator: Estimator = "group_norm", *,
                        normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages [num_prompts, samples_per_prompt] by `estimator` (formulas in
    the module docstring); `normalize_std` is group_norm's (False: Dr. GRPO). All-equal groups
    give exactly 0. The dtype of the input, at least fp32; no gradient flows."""
    if estimator == "group_norm":
        return group_advantages(rewards_G_N, normalize_std=normalize_std, eps=eps)
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {', '.join(ESTIMATORS)}; got "
                         f"{estimator!r}")
    centered_G_N = group_advantages(rewards_G_N, normalize_std=False, eps=eps)
    n = rewards_G_N.shape[1]
    if estimator == "rloo":
        return centered_G_N * (n / (n - 1))
    flat = centered_G_N.flatten()
    if flat.numel() < 2:
        return centered_G_N
    adv_G_N = (centered_G_N - flat.mean()) / (flat.std() + eps)
    return adv_G_N.masked_fill(centered_G_N.eq(0).all(dim=1, keepdim=True), 0.0)


def group_advantages(rewards_G_N: torch.Tensor, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages [num_prompts, samples_per_prompt] (formula in the module
    docstring): reward minus the group mean, divided by the group std + eps if `normalize_std`
    (GRPO) or not (Dr. GRPO). All-equal groups give exactly 0. Returns the dtype of the input,
    at least fp32; no gradient flows.
    """
    if rewards_G_N.dim() != 2:
        raise ValueError(f"rewards_G_N must be [num_prompts, samples_per_prompt], got shape "
                         f"{tuple(rewards_G_N.shape)}; reshape flat rewards with "
                         f".view(num_prompts, samples_per_prompt)")
    if rewards_G_N.shape[1] < 2:
        raise ValueError(f"samples_per_prompt is {rewards_G_N.shape[1]}; group-relative "
                         f"advantages need at least 2 samples per prompt (with 1 every "
                         f"advantage is 0)")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r_G_N = _wide(rewards_G_N).detach()
    if not bool(torch.isfinite(r_G_N).all()):
        raise ValueError("rewards_G_N holds NaN or inf; fix the reward function")
    adv_G_N = r_G_N - r_G_N.mean(dim=1, keepdim=True)
    if normalize_std:
        adv_G_N = adv_G_N / (r_G_N.std(dim=1, keepdim=True) + eps)
    # The mean of equal floats need not equal them exactly (3 x 0.1), and with eps tiny the
    # rounding residue would be blown up into a spurious advantage.
    constant_G_1 = (r_G_N.amax(dim=1, keepdim=True) == r_G_N.amin(dim=1, keepdim=True))
    return adv_G_N.masked_fill(constant_G_1, 0.0)


def grpo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
              mask_BT: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
              ref_logp_BT: torch.Tensor | None = None, kl_coef: float = 0.0,
              engine_logp_BT: torch.Tensor | None = None, is_cap: float | None = None,
              aggregation: Aggregation = "token_mean", constant_norm: float | None = None,
              global_tokens: int | None = None, global_sequences: int | None = None,
              held_BT: torch.Tensor | None = None, ratio: Ratio = "token",
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss over B responses, one per row (formulas in the module
    docstring).

    Args:
        logp_BT: log pi(y_t | ...) of the sampled tokens under the policy (differentiable),
            e.g. from `chunked_logprobs`.
        old_logp_BT: the same under the policy that generated the batch (detached); pass
            ``logp_BT.detach()`` for one update per batch.
        advantages_B: one advantage per response (e.g. `group_advantages(...).flatten()`),
            or [B, T] one per token (PPO's GAE, `posttrain.losses.ppo`; masked-out positions
            may hold anything).
        mask_BT: bool or 0/1, set on the response tokens that carry loss. Masked-out positions
            may hold anything, NaN and inf included.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        ref_logp_BT, kl_coef: frozen reference log-probs and the weight of the k3 KL penalty.
            With ``kl_coef=0`` a given reference is used for the ``kl`` metric only.
        engine_logp_BT, is_cap: the inference engine's log-probs of the same tokens, and the
            cap of the importance weight pi_old / pi_engine (None: not truncated).
        aggregation: "seq_mean_token_mean" (GRPO), "token_mean" (DAPO) or "constant"
            (Dr. GRPO, normalizer ``constant_norm``, default the row length T).
        global_tokens: token_mean only: the step's response-token count over all micro-batches
            and ranks, used instead of this batch's.
        global_sequences: seq_mean_token_mean and constant only: the step's sequence count over
            all micro-batches and ranks, used instead of this batch's.
        held_BT: with context parallelism, the tokens this rank holds (its log-probs are valid
            there only): the loss is this rank's part of the batch's, its terms summed over the
            held tokens and normalized by the whole batch's counts (a response's token count
            from `mask_BT`), so the parts add up over the group; metrics are over held tokens.
        ratio: "token" (PPO/GRPO) or "sequence" (GSPO: one ratio per response, module
            docstring); "sequence" needs every token of a response, so not with `held_BT`.

    Returns:
        (loss, metrics): loss is an fp32 scalar (fp64 for fp64 input); a batch without response
        tokens gives 0 with zero gradient. Metrics are detached means over this batch's response
        tokens: ``clip_fraction_low`` (A < 0 and rho < 1 - clip_low: the clip zeroes the
        gradient), ``clip_fraction_high`` (A > 0 and rho > 1 + clip_high), ``ratio_mean``,
        ``ratio_max``, ``pg_loss`` (token mean of w pg), and when given ``kl`` (token mean of
        k3), ``is_weight_mean`` and ``is_truncated_fraction``.
    """
    _check_args(logp_BT, old_logp_BT, advantages_B, mask_BT, ref_logp_BT, engine_logp_BT,
                clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, is_cap=is_cap,
                aggregation=aggregation, constant_norm=constant_norm,
                global_tokens=global_tokens, global_sequences=global_sequences)
    if ratio not in ("token", "sequence"):
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    if ratio == "sequence" and held_BT is not None:
        raise ValueError("ratio='sequence' needs every token of a response on this rank; it "
                         "does not combine with context parallelism (held_BT)")
    counts_BT = mask_BT.bool()          # what the normalizers count: the whole responses
    m_BT = counts_BT if held_BT is None else counts_BT & held_BT.bool()
    logp = _wide(logp_BT)
    log_s_B1 = None
    if ratio == "sequence":                # GSPO-token: value s_b, gradient s_b grad logp
        log_ratio_BT = (logp - _wide(old_logp_BT)).detach().where(m_BT, 0.0)
        log_s_B1 = (log_ratio_BT.sum(dim=1, keepdim=True)
                    / m_BT.sum(dim=1, keepdim=True).clamp(min=1))
    adv_B1 = _wide(advantages_B).detach().to(logp.dtype)     # [B, 1], or [B, T] per token
    adv_B1 = adv_B1.unsqueeze(1) if adv_B1.dim() == 1 else adv_B1
    loss_BT, ratio_BT, pg_BT, is_weight_BT, kl_BT = _token_terms(
        logp, _wide(old_logp_BT), adv_B1, m_BT, clip_low=clip_low, clip_high=clip_high,
        engine_logp=None if engine_logp_BT is None else _wide(engine_logp_BT), is_cap=is_cap,
        ref_logp=None if ref_logp_BT is None else _wide(ref_logp_BT), kl_coef=kl_coef,
        log_s=log_s_B1)

    loss = _aggregate(loss_BT.where(m_BT, 0.0), counts_BT, aggregation, constant_norm,
                      global_tokens, global_sequences)

    with torch.no_grad():
        n = m_BT.sum().clamp(min=1)

        def token_mean(x_BT: torch.Tensor) -> torch.Tensor:
            return x_BT.where(m_BT, 0.0).sum() / n

        metrics = {
            "clip_fraction_low": token_mean(((adv_B1 < 0) & (ratio_BT < 1.0 - clip_low))
                                            .to(logp.dtype)),
            "clip_fraction_high": token_mean(((adv_B1 > 0) & (ratio_BT > 1.0 + clip_high))
                                             .to(logp.dtype)),
            "ratio_mean": token_mean(ratio_BT),
            "ratio_max": (ratio_BT.where(m_BT, -torch.inf).max() if bool(m_BT.any())
                          else ratio_BT.new_zeros(())),
            "pg_loss": token_mean(pg_BT),
        }
        if kl_BT is not None:
            metrics["kl"] = token_mean(kl_BT)
        if is_weight_BT is not None:
            metrics["is_weight_mean"] = token_mean(is_weight_BT)
            truncated_BT = (is_weight_BT >= is_cap if is_cap is not None
                            else torch.zeros_like(m_BT))
            metrics["is_truncated_fraction"] = token_mean(truncated_BT.to(logp.dtype))
    return loss, metrics


def _token_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                 m: torch.Tensor, *, clip_low: float, clip_high: float,
                 engine_logp: torch.Tensor | None, is_cap: float | None,
                 ref_logp: torch.Tensor | None, kl_coef: float, log_s: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
    """The per-token terms of the module docstring on tensors of one shape (or broadcasting):
    (L, rho, w pg, w or None, k3 or None), L as yet unmasked. Without `log_s` term t reads
    logp_t alone, so the loss root can take the terms' slopes chunk by chunk
    (`grpo_token_objective`); GSPO's `log_s` (detached) needs all of a response's log-probs
    first."""
    # where, not multiply: a masked position may hold -inf or NaN, and 0 * inf is NaN.
    log_ratio = (logp - old_logp.detach()).where(m, 0.0)
    if log_s is not None:
        log_ratio = (log_s + logp - logp.detach()).where(m, 0.0)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(unclipped, clipped)
    is_weight = None
    if engine_logp is not None:
        is_weight = (old_logp - engine_logp).detach().where(m, 0.0).exp()
        if is_cap is not None:
            is_weight = is_weight.clamp(max=is_cap)
        pg = is_weight * pg
    loss, kl = pg, None
    if ref_logp is not None:
        d = (ref_logp.detach() - logp).where(m, 0.0)
        kl = d.exp() - d - 1.0
        if kl_coef:
            loss = loss + kl_coef * kl
    return loss, ratio, pg, is_weight, kl


def head_gradients_in_forward(ratio: Ratio, context_parallel: bool) -> bool:
    """Whether the loss root forms the LM head's gradients in the forward (one projection per
    chunk, `grpo_token_objective`): with the token ratio, whose terms each read their own
    log-prob, and without context parallelism, whose ranks hold parts of a response."""
    return ratio == "token" and not context_parallel


def grpo_token_objective(old_logp: torch.Tensor | None, advantages: torch.Tensor,
                         mask: torch.Tensor, weights: torch.Tensor, *, clip_low: float,
                         clip_high: float, engine_logp: torch.Tensor | None,
                         is_cap: float | None, ref_logp: torch.Tensor | None, kl_coef: float
                         ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`grpo_loss`'s loss (token ratio) as a token-separable objective for
    `posttrain.ops.cross_entropy.chunked_logprob_objective`: the per-position constants are
    given in one flat layout (old log-probs, None on policy: each position's own, detached;
    advantages; the mask; `aggregation_weights`; the engine's and reference's log-probs), and
    the objective maps a chunk's log-probs at `positions` to its terms w L."""
    def objective(logp_c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        def at(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[positions]

        m_c = mask[positions]
        old_c = logp_c.detach() if old_logp is None else old_logp[positions]
        loss_c = _token_terms(logp_c, old_c, advantages[positions], m_c, clip_low=clip_low,
                              clip_high=clip_high, engine_logp=at(engine_logp), is_cap=is_cap,
                              ref_logp=at(ref_logp), kl_coef=kl_coef)[0]
        return loss_c.where(m_c, 0.0) * weights[positions]
    return objective


def aggregation_weights(m_BT: torch.Tensor, aggregation: str, constant_norm: float | None,
                        global_tokens: int | None, global_sequences: int | None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each token's weight in the aggregated loss (0 off the mask `m_BT`, the responses'
    tokens that the normalizers count): the loss is sum_bt weight_bt L_bt."""
    m = m_BT.to(dtype)
    if aggregation == "token_mean":
        count = global_tokens if global_tokens is not None else int(m_BT.sum())
        return m / max(count, 1)
    num_seq = global_sequences if global_sequences is not None else int(m_BT.any(dim=1).sum())
    if aggregation == "seq_mean_token_mean":
        return m / (m.sum(dim=1, keepdim=True).clamp(min=1) * max(num_seq, 1))
    norm = constant_norm if constant_norm is not None else m_BT.shape[1]
    return m / (max(num_seq, 1) * norm)


def _aggregate(loss_BT: torch.Tensor, m_BT: torch.Tensor, aggregation: str,
               constant_norm: float | None, global_tokens: int | None,
               global_sequences: int | None) -> torch.Tensor:
    """Reduce masked per-token losses (already 0 off the mask) to a scalar."""
    weights_BT = aggregation_weights(m_BT, aggregation, constant_norm, global_tokens,
                                     global_sequences, loss_BT.dtype)
    return (loss_BT * weights_BT).sum()


def _check_args(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
                mask_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None,
                engine_logp_BT: torch.Tensor | None, *, clip_low: float, clip_high: float,
                kl_coef: float, is_cap: float | None, aggregation: str,
                constant_norm: float | None, global_tokens: int | None,
                global_sequences: int | None) -> None:
    if logp_BT.dim() != 2:
        raise ValueError(f"logp_BT must be [B, T], got shape {tuple(logp_BT.shape)}")
    for name, t in (("old_logp_BT", old_logp_BT), ("mask_BT", mask_BT),
                    ("ref_logp_BT", ref_logp_BT), ("engine_logp_BT", engine_logp_BT)):
        if t is not None and t.shape != logp_BT.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp_BT "
                             f"{tuple(logp_BT.shape)}; they must match")
    if advantages_B.shape not in (logp_BT.shape[:1], logp_BT.shape):
        raise ValueError(f"advantages_B must be [B] = [{logp_BT.shape[0]}] (one per response "
                         f"row) or [B, T] = {list(logp_BT.shape)} (one per token), got shape "
                         f"{tuple(advantages_B.shape)}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) (the ratio's lower bound is "
                         f"1 - clip_low), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and ref_logp_BT is None:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logp_BT is None; pass the reference "
                         f"model's log-probs or set kl_coef=0")
    if is_cap is not None:
        if engine_logp_BT is None:
            raise ValueError(f"is_cap is {is_cap} but engine_logp_BT is None; pass the "
                             f"inference engine's log-probs or set is_cap=None")
        if is_cap <= 0.0:
            raise ValueError(f"is_cap must be > 0, got {is_cap}")
    _check_aggregation(aggregation, constant_norm, global_tokens, global_sequences)


def _check_aggregation(aggregation: str, constant_norm: float | None,
                       global_tokens: int | None, global_sequences: int | None) -> None:
    """The aggregation arguments of `grpo_loss` (and of `posttrain.losses.ppo.value_loss`)."""
    if aggregation not in ("seq_mean_token_mean", "token_mean", "constant"):
        raise ValueError(f"aggregation must be 'seq_mean_token_mean', 'token_mean' or "
                         f"'constant'; got {aggregation!r}")
    if constant_norm is not None:
        if aggregation != "constant":
            raise ValueError(f"constant_norm applies to aggregation='constant' only; got "
                             f"{constant_norm} with {aggregation!r} (set it to None)")
        if constant_norm <= 0:
            raise ValueError(f"constant_norm must be > 0, got {constant_norm}")
    if global_tokens is not None:
        if aggregation != "token_mean":
            raise ValueError(f"global_tokens applies to aggregation='token_mean' only; got "
                             f"{aggregation!r} (use global_sequences)")
        if global_tokens < 0:
            raise ValueError(f"global_tokens must be >= 0, got {global_tokens}")
    if global_sequences is not None:
        if aggregation == "token_mean":
            raise ValueError("global_sequences applies to 'seq_mean_token_mean' and 'constant' "
                             "only; with 'token_mean' pass global_tokens")
        if global_sequences < 0:
            raise ValueError(f"global_sequences must be >= 0, got {global_sequences}")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 log-probs are too coarse to subtract); fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
