"""Cross-entropy and log-probs over a large vocabulary without [tokens, vocab] logits.

With hidden states h_n (after the final norm), an LM head W [V_padded, H] (optionally a bias b),
and targets y_n, the quantities are

    x_n     = W[:V] h_n + b[:V]                      (only the V = real_vocab_size real rows)
    z_n     = softcap * tanh(x_n / softcap) / tau    (softcap optional; tau = temperature)
    lse_n   = log sum_v exp(z_nv)
    logp_n  = z_{n, y_n} - lse_n                     (log p(y_n))
    loss    = -sum_n logp_n   or   -mean_n logp_n    (over positions whose label != ignore_index)

Rows of W past `real_vocab_size` (vocabulary padding) are never projected: their logit is -inf,
their probability 0 and their gradient exactly 0.

The kernels (`posttrain.ops.head_kernels`) work chunk by chunk (`chunk_tokens` positions at a
time). `ChunkedTargetLogProb` (behind `chunked_logprobs`) keeps only lse_n between forward and
backward; backward recomputes each chunk's logits and uses

    d logp_n / d z_nv = 1[v == y_n] - softmax(z_n)_v
    d z_nv / d x_nv   = (1 - tanh^2(x_nv / softcap)) / tau

accumulating grad_hidden per chunk and grad_weight / grad_bias across chunks in fp32.
`ChunkedObjective` (behind `chunked_cross_entropy`, a scalar loss with one incoming gradient for
every position) forms these gradients in the forward pass while each chunk's logits exist and
only scales them in backward: one projection per chunk instead of two.
`chunked_logprob_objective` does the same for any token-separable loss sum_n f_n(logp_n), each
term a function of its own log-prob only (GRPO's per-token clipped objective is one): each
chunk's d f_n / d logp_n is taken by autograd from the chunk's log-probs and scales the chunk's
softmax gradient. Peak extra memory is one or two [chunk_tokens, V] fp32 blocks plus the fp32
grad_weight accumulator, instead of several [N, V] blocks (see bench/loss_memory.py). Ignored
positions are dropped with `index_select` before the projection, so padding and prompt tokens
cost nothing.

`naive_cross_entropy` and `naive_logprobs` are the plain full-logits formulas, the numerical
reference for tests and benches.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

from posttrain.ops.head_kernels import (ChunkedObjective, ChunkedTargetLogProb, check_chunk,
                                        chunk_logits)

__all__ = ["chunked_argmax", "chunked_cross_entropy", "chunked_entropy",
           "chunked_logprob_objective", "chunked_logprobs", "naive_cross_entropy",
           "naive_logprobs"]

IGNORE_INDEX = -100
# a token-separable loss: (log-probs of a chunk [c], their positions) -> its terms [c]
Objective = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                          reduction: Literal["sum", "mean"] = "mean",
                          softcap: float | None = None, bias: torch.Tensor | None = None,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token cross-entropy of `hidden @ weight.T` against `labels`, chunked.

    Args:
        hidden: [N, H] or [B, T, H] final hidden states.
        weight: [V_padded, H] LM head (or tied embedding).
        labels: [N] or [B, T] target ids, already aligned with `hidden` (shifted by the caller);
            `ignore_index` marks positions without loss.
        real_vocab_size: the tokenizer's vocabulary; rows of `weight` past it are padding.
        chunk_tokens: positions per chunk; peak memory ~ chunk_tokens x real_vocab_size x 4 bytes.
        reduction: "sum" over kept positions, or "mean" over kept positions.
        softcap: final-logit soft-capping (Gemma).
        bias: [V_padded] LM head bias, if any.

    Returns:
        fp32 scalar. With every position ignored it is 0 (with zero gradients), where
        F.cross_entropy(reduction="mean") would give NaN.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    hidden_NH, labels_N = _flatten(hidden, labels, "labels")
    real = _real_vocab(weight, real_vocab_size)
    keep_N = labels_N != ignore_index
    kept = keep_N.nonzero().squeeze(1)
    targets_K = labels_N.index_select(0, kept)
    _check_targets(targets_K, real, "labels")
    # a named range in profiles: the head's whole cost (its gradients are formed here)
    with torch.profiler.record_function("chunked_cross_entropy"):
        loss, _, _ = ChunkedObjective.apply(hidden_NH.index_select(0, kept), weight, bias,
                                            targets_K, real, chunk_tokens, softcap, 1.0, None,
                                            False)
    if reduction == "mean":
        loss = loss / max(targets_K.numel(), 1)
    return loss


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *,
                     real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                     softcap: float | None = None, temperature: float = 1.0,
                     bias: torch.Tensor | None = None,
                     ignore_index: int = IGNORE_INDEX, return_entropy: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(token) at every position, differentiable, for DPO / GRPO / distillation.

    `tokens` is aligned with `hidden` like `labels` in `chunked_cross_entropy`. Logits are divided
    by `temperature` after the softcap (as a sampler does). Positions equal to `ignore_index` are
    not projected and get log-prob 0. Returns fp32 of the shape of `tokens`; with
    `return_entropy` also the entropy of each projected position's distribution (as
    `chunked_entropy`, not differentiable, 0 at ignored positions), computed from the same
    logits instead of a second projection.
    """
    hidden_KH, targets_K, kept, real = _projected(hidden, weight, tokens, real_vocab_size,
                                                  temperature, ignore_index)
    out = ChunkedTargetLogProb.apply(hidden_KH, weight, bias, targets_K, real, chunk_tokens,
                                     softcap, float(temperature), return_entropy)
    logp_K, entropy_K = out if return_entropy else (out, None)
    if not return_entropy:
        return _placed(logp_K, kept, tokens)
    return _placed(logp_K, kept, tokens), _placed(entropy_K, kept, tokens)


def chunked_logprob_objective(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                              objective: Objective, *, real_vocab_size: int | None = None,
                              chunk_tokens: int = 1024, softcap: float | None = None,
                              temperature: float = 1.0, bias: torch.Tensor | None = None,
                              ignore_index: int = IGNORE_INDEX, return_entropy: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A token-separable loss of the log-probs, its gradients formed while each chunk's logits
    exist (one projection per chunk, as `chunked_cross_entropy`).

    ``objective(logp_c, positions_c)`` gets the log-probs of a chunk of projected positions
    (fp32 [c], differentiable) and their indices into the flattened `tokens`, and returns the
    chunk's loss terms [c]. The loss is the sum of all terms, and term n may depend on
    logp_n alone (with constants): its gradient is taken per chunk, so a term that reads other
    positions' log-probs would get a wrong gradient. Positions equal to `ignore_index` are not
    projected and have no term.

    Returns ``(loss, logp, entropy)``: the fp32 scalar loss (differentiable with respect to
    hidden, weight and bias), the log-probs shaped like `tokens` (detached, 0 at ignored
    positions, equal to `chunked_logprobs`'), and with `return_entropy` the entropy per position
    as `chunked_logprobs` gives it, else None.
    """
    hidden_KH, targets_K, kept, real = _projected(hidden, weight, tokens, real_vocab_size,
                                                  temperature, ignore_index)

    def terms(logp_c: torch.Tensor, rows: slice) -> torch.Tensor:
        return objective(logp_c, kept[rows])

    with torch.profiler.record_function("chunked_logprob_objective"):
        loss, logp_K, entropy_K = ChunkedObjective.apply(
            hidden_KH, weight, bias, targets_K, real, chunk_tokens, softcap, float(temperature),
            terms, return_entropy)
    return (loss, _placed(logp_K, kept, tokens),
            _placed(entropy_K, kept, tokens) if return_entropy else None)


@torch.no_grad()
def chunked_entropy(hidden: torch.Tensor, weight: torch.Tensor, *,
                    real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                    softcap: float | None = None, temperature: float = 1.0,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution per position, H_n = lse_n - sum_v p_nv z_nv.

    A metric (not differentiable). `hidden` is [N, H] or [B, T, H]; returns fp32 [N] or [B, T].
    """
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    real = _real_vocab(weight, real_vocab_size)
    out = []
    for h_cH in hidden_NH.split(check_chunk(chunk_tokens)):
        z_cV, _ = chunk_logits(h_cH, weight, bias, real, softcap, temperature)
        logp_cV = torch.log_softmax(z_cV, dim=-1)
        out.append(-(logp_cV.exp() * logp_cV).sum(-1))
    entropy_N = torch.cat(out) if out else hidden_NH.new_zeros(0, dtype=torch.float32)
    return entropy_N.view(hidden.shape[:-1])


@torch.no_grad()
def chunked_argmax(hidden: torch.Tensor, weight: torch.Tensor, *,
                   real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                   softcap: float | None = None, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The most likely next token per position, over the real vocabulary (for top-1 accuracy).

    A metric (not differentiable). `hidden` is [N, H] or [B, T, H]; returns int64 [N] or [B, T].
    """
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    real = _real_vocab(weight, real_vocab_size)
    out = [chunk_logits(h_cH, weight, bias, real, softcap, 1.0)[0].argmax(dim=-1)
           for h_cH in hidden_NH.split(check_chunk(chunk_tokens))]
    ids_N = torch.cat(out) if out else hidden_NH.new_zeros(0, dtype=torch.int64)
    return ids_N.view(hidden.shape[:-1])


# --------------------------------------------------------------------------- references


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *,
                   real_vocab_size: int | None = None, softcap: float | None = None,
                   temperature: float = 1.0, bias: torch.Tensor | None = None,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Reference: full [N, V_padded] fp32 logits, padded columns set to -inf, log_softmax."""
    from posttrain.ops.vocab import mask_padded_logits

    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = mask_padded_logits(logits, _real_vocab(weight, real_vocab_size)) / temperature
    keep = tokens != ignore_index
    logp = torch.log_softmax(logits, dim=-1)
    logp = logp.gather(-1, tokens.where(keep, 0).unsqueeze(-1)).squeeze(-1)
    return logp.where(keep, 0.0)


def naive_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                        real_vocab_size: int | None = None,
                        reduction: Literal["sum", "mean"] = "mean",
                        softcap: float | None = None, bias: torch.Tensor | None = None,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Reference: F.cross_entropy on full fp32 logits with padded columns at -inf."""
    from posttrain.ops.vocab import mask_padded_logits

    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = mask_padded_logits(logits, _real_vocab(weight, real_vocab_size))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


# --------------------------------------------------------------------------- checks


def _flatten(hidden: torch.Tensor, ids: torch.Tensor,
             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if hidden.shape[:-1] != ids.shape or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H] and {name} [N] or [B, T] with the "
                         f"same leading shape; got hidden {tuple(hidden.shape)}, "
                         f"{name} {tuple(ids.shape)}")
    return hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)


def _projected(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
               real_vocab_size: int | None, temperature: float, ignore_index: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The checked inputs of the log-prob kernels: (hidden rows of the projected positions,
    their target ids, those positions in the flattened `tokens`, the real vocabulary)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    hidden_NH, tokens_N = _flatten(hidden, tokens, "tokens")
    real = _real_vocab(weight, real_vocab_size)
    kept = (tokens_N != ignore_index).nonzero().squeeze(1)
    targets_K = tokens_N.index_select(0, kept)
    _check_targets(targets_K, real, "tokens")
    return hidden_NH.index_select(0, kept), targets_K, kept, real


def _placed(values_K: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-position values of the projected positions laid out like `tokens`, 0 elsewhere."""
    return values_K.new_zeros(tokens.numel()).index_copy(0, kept, values_K).view(tokens.shape)


def _real_vocab(weight: torch.Tensor, real_vocab_size: int | None) -> int:
    padded = weight.shape[0]
    if real_vocab_size is None:
        return padded
    if not 0 < real_vocab_size <= padded:
        raise ValueError(f"real_vocab_size {real_vocab_size} must be in [1, {padded}] "
                         f"(the LM head has {padded} rows)")
    return real_vocab_size


def _check_targets(targets_K: torch.Tensor, real: int, name: str) -> None:
    if targets_K.numel() and (bool((targets_K < 0).any()) or bool((targets_K >= real).any())):
        bad = targets_K[(targets_K < 0) | (targets_K >= real)][:5].tolist()
        raise ValueError(f"{name} must be token ids in [0, {real}) or the ignore index; found "
                         f"{bad} (a padded vocabulary id or a wrong ignore index?)")
