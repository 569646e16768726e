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

`_ChunkedTargetLogProb` computes logp_n chunk by chunk (`chunk_tokens` positions at a time), keeping
only lse_n between forward and backward. Backward recomputes each chunk's logits and uses

    d logp_n / d z_nv = 1[v == y_n] - softmax(z_n)_v
    d z_nv / d x_nv   = (1 - tanh^2(x_nv / softcap)) / tau

accumulating grad_hidden per chunk and grad_weight / grad_bias across chunks in fp32.
`chunked_cross_entropy` (a scalar loss, one incoming gradient for every position) uses
`_ChunkedCrossEntropySum` instead, which forms these gradients in the forward pass while each
chunk's logits exist and only scales them in backward: one projection per chunk instead of two.
Peak extra
memory is a few [chunk_tokens, V] fp32 blocks plus the fp32 grad_weight accumulator, instead of
several [N, V] blocks (see bench/loss_memory.py). Ignored positions are dropped with
`index_select` before the projection, so padding and prompt tokens cost nothing.

`naive_cross_entropy` and `naive_logprobs` are the plain full-logits formulas, the numerical
reference for tests and benches.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["chunked_argmax", "chunked_cross_entropy", "chunked_entropy", "chunked_logprobs",
           "naive_cross_entropy", "naive_logprobs"]

IGNORE_INDEX = -100


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
        loss = _ChunkedCrossEntropySum.apply(hidden_NH.index_select(0, kept), weight, bias,
                                             targets_K, real, chunk_tokens, softcap)
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
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    hidden_NH, tokens_N = _flatten(hidden, tokens, "tokens")
    real = _real_vocab(weight, real_vocab_size)
    kept = (tokens_N != ignore_index).nonzero().squeeze(1)
    targets_K = tokens_N.index_select(0, kept)
    _check_targets(targets_K, real, "tokens")
    out = _ChunkedTargetLogProb.apply(hidden_NH.index_select(0, kept), weight, bias, targets_K,
                                      real, chunk_tokens, softcap, float(temperature),
                                      return_entropy)
    logp_K, entropy_K = out if return_entropy else (out, None)
    logp_N = logp_K.new_zeros(tokens_N.shape).index_copy(0, kept, logp_K)
    if not return_entropy:
        return logp_N.view(tokens.shape)
    entropy_N = entropy_K.new_zeros(tokens_N.shape).index_copy(0, kept, entropy_K)
    return logp_N.view(tokens.shape), entropy_N.view(tokens.shape)


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
    for h_cH in hidden_NH.split(_check_chunk(chunk_tokens)):
        z_cV, _ = _chunk_logits(h_cH, weight, bias, real, softcap, temperature)
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
    out = [_chunk_logits(h_cH, weight, bias, real, softcap, 1.0)[0].argmax(dim=-1)
           for h_cH in hidden_NH.split(_check_chunk(chunk_tokens))]
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


# --------------------------------------------------------------------------- the kernel


class _ChunkedTargetLogProb(torch.autograd.Function):
    """logp_K = log_softmax(z)[target] for K kept positions, chunked; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, hidden_KH: torch.Tensor, weight_VH: torch.Tensor,
                bias_V: torch.Tensor | None, targets_K: torch.Tensor, real: int, chunk_tokens: int,
                softcap: float | None, temperature: float, return_entropy: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        chunk = _check_chunk(chunk_tokens)
        lse_K = hidden_KH.new_empty(hidden_KH.shape[0], dtype=torch.float32)
        logp_K = torch.empty_like(lse_K)
        entropy_K = torch.empty_like(lse_K) if return_entropy else None
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            z_cV, _ = _chunk_logits(hidden_KH[sl], weight_VH, bias_V, real, softcap, temperature)
            target_c = z_cV.gather(1, targets_K[sl, None]).squeeze(1)
            max_c = z_cV.amax(dim=-1)
            shifted_cV = z_cV.sub_(max_c[:, None])
            if entropy_K is None:
                # logsumexp in place: torch.logsumexp would hold a second [chunk, V] block.
                lse_K[sl] = shifted_cV.exp_().sum(dim=-1).log_().add_(max_c)
            else:
                # H = log S - sum_v e_v (z_v - max) / S with e = exp(z - max), S = sum_v e_v
                e_cV = shifted_cV.exp()
                log_sum_c = e_cV.sum(dim=-1).log_()
                lse_K[sl] = log_sum_c + max_c
                weighted_c = e_cV.mul_(shifted_cV).sum(dim=-1)
                entropy_K[sl] = log_sum_c - weighted_c / log_sum_c.exp()
                del e_cV
            logp_K[sl] = target_c - lse_K[sl]
            del z_cV, shifted_cV
        ctx.save_for_backward(hidden_KH, weight_VH, bias_V, targets_K, lse_K)
        ctx.config = (real, chunk, softcap, temperature)
        if entropy_K is None:
            return logp_K
        ctx.mark_non_differentiable(entropy_K)
        return logp_K, entropy_K

    @staticmethod
    def backward(ctx: Any, grad_logp_K: torch.Tensor, *_: Any
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden_KH, weight_VH, bias_V, targets_K, lse_K = ctx.saved_tensors
        real, chunk, softcap, temperature = ctx.config
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = _GradSums(hidden_KH, weight_VH, bias_V, need_h, need_w, need_b)
        grad_logp_K = grad_logp_K.float()
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            z_cV, tanh_cV = _chunk_logits(hidden_KH[sl], weight_VH, bias_V, real, softcap,
                                          temperature, want_tanh=True)
            # d logp / d z = onehot(y) - p, scaled by the incoming gradient; built in place.
            g_cV = z_cV.sub_(lse_K[sl, None]).exp_()
            g_cV.scatter_add_(1, targets_K[sl, None], g_cV.new_full((g_cV.shape[0], 1), -1.0))
            g_cV.mul_(-grad_logp_K[sl, None])
            if temperature != 1.0:
                g_cV.div_(temperature)
            if tanh_cV is not None:
                g_cV.mul_(tanh_cV.square_().neg_().add_(1.0))  # d/dx c*tanh(x/c) = 1 - tanh^2
            grads.add(sl, g_cV, hidden_KH[sl], real)
            del z_cV, tanh_cV, g_cV
        grad_h, grad_w, grad_b = grads.done()
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """loss = -sum_K logp_K, with the gradients computed in the forward pass.

    A scalar loss has one incoming gradient for all positions, so d loss / d hidden and
    d loss / d weight can be formed chunk by chunk while each chunk's logits are at hand, and
    backward only scales them: the logits are projected once instead of twice (forward, then
    recomputed in backward), which saves a third of the LM head's matmul FLOPs. Extra memory
    until backward: grad_hidden [K, H] (it replaces the saved hidden) and the fp32 grad_weight
    accumulator, which the backward of `_ChunkedTargetLogProb` allocates anyway.
    """

    @staticmethod
    def forward(ctx: Any, hidden_KH: torch.Tensor, weight_VH: torch.Tensor,
                bias_V: torch.Tensor | None, targets_K: torch.Tensor, real: int,
                chunk_tokens: int, softcap: float | None) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk = _check_chunk(chunk_tokens)
        grads = _GradSums(hidden_KH, weight_VH, bias_V, need_h, need_w, need_b)
        loss = torch.zeros((), dtype=torch.float64, device=hidden_KH.device)
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            h_cH = hidden_KH[sl]
            z_cV, tanh_cV = _chunk_logits(h_cH, weight_VH, bias_V, real, softcap, 1.0,
                                          want_tanh=grads.any)
            target_c = z_cV.gather(1, targets_K[sl, None]).squeeze(1)
            max_c = z_cV.amax(dim=-1)
            # exp(z - max) in place: the unnormalised softmax, then lse; no second [chunk, V]
            p_cV = z_cV.sub_(max_c[:, None]).exp_()
            sum_c = p_cV.sum(dim=-1)
            lse_c = sum_c.log().add_(max_c)
            loss += (lse_c - target_c).sum(dtype=torch.float64)
            if grads.any:
                # d(-logp)/dz = p - onehot(y)
                g_cV = p_cV.div_(sum_c[:, None])
                g_cV.scatter_add_(1, targets_K[sl, None], g_cV.new_full((g_cV.shape[0], 1), -1.0))
                if tanh_cV is not None:
                    g_cV.mul_(tanh_cV.square_().neg_().add_(1.0))
                grads.add(sl, g_cV, h_cH, real)
                del g_cV        # p_cV's buffer: freed before the next chunk's logits exist
            del z_cV, tanh_cV, p_cV
        ctx.grads = grads.done() if grads.any else None
        return loss.float()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        scale = grad_loss.float()

        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.mul_(scale.to(g.dtype))

        return scaled(grad_h), scaled(grad_w), scaled(grad_b), None, None, None, None


class _GradSums:
    """grad_hidden rows and the fp32 grad_weight / grad_bias sums of the chunked head, given
    each chunk's d loss / d z (fp32 [chunk, real]); shared by both kernels."""

    def __init__(self, hidden_KH: torch.Tensor, weight_VH: torch.Tensor,
                 bias_V: torch.Tensor | None, need_h: bool, need_w: bool, need_b: bool):
        self.dtype, self.w_dtype = hidden_KH.dtype, weight_VH.dtype
        self.b_dtype = None if bias_V is None else bias_V.dtype
        self.weight_VH = weight_VH
        self.any = need_h or need_w or need_b
        self.h = torch.empty_like(hidden_KH) if need_h else None
        self.w32 = (torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
                    if need_w else None)
        self.b32 = (torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device)
                    if need_b else None)

    def add(self, sl: slice, g_cV: torch.Tensor, h_cH: torch.Tensor, real: int) -> None:
        g_low = g_cV.to(self.dtype)
        if self.h is not None:
            self.h[sl] = g_low @ self.weight_VH[:real]
        if self.w32 is not None:
            if g_low.dtype == torch.float32:
                self.w32[:real].addmm_(g_low.T, h_cH)
            else:
                self.w32[:real] += (g_low.T @ h_cH).float()
        if self.b32 is not None:
            self.b32[:real] += g_cV.sum(0)

    def done(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        w = None if self.w32 is None else self.w32.to(self.w_dtype)
        b = None if self.b32 is None else self.b32.to(self.b_dtype)
        self.weight_VH = None
        return self.h, w, b


def _chunk_logits(h_cH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                  real: int, softcap: float | None, temperature: float, *,
                  want_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z = softcap(h W[:real].T + b[:real]) / temperature in fp32, and, with `want_tanh` and a
    softcap, tanh(x / softcap) for the softcap derivative (a second [chunk, V] block)."""
    bias = None if bias_V is None else bias_V[:real]
    z_cV = F.linear(h_cH, weight_VH[:real], bias).float()
    tanh_cV = None
    if softcap is not None:
        z_cV = z_cV.div_(softcap).tanh_()
        if want_tanh:
            tanh_cV, z_cV = z_cV, z_cV * softcap
        else:
            z_cV.mul_(softcap)
    if temperature != 1.0:
        z_cV = z_cV.div_(temperature)
    return z_cV, tanh_cV


# --------------------------------------------------------------------------- checks


def _flatten(hidden: torch.Tensor, ids: torch.Tensor,
             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if hidden.shape[:-1] != ids.shape or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H] and {name} [N] or [B, T] with the "
                         f"same leading shape; got hidden {tuple(hidden.shape)}, "
                         f"{name} {tuple(ids.shape)}")
    return hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)


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


def _check_chunk(chunk_tokens: int) -> int:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return int(chunk_tokens)
