"""Knowledge distillation from a frozen teacher, over a large vocabulary without [N, V] logits.

At each kept position n (label != -100), with student logits x_n = W_s h_n and teacher logits
y_n = W_t g_n over the V = real_vocab_size real rows, both divided by the temperature T:

    Q_n = softmax(x_n / T)      the student  (log-probs l)
    P_n = softmax(y_n / T)      the teacher  (log-probs t)

    forward_kl   KL(P || Q) = sum_v P (t - l)                          (Hinton et al. 2015)
    reverse_kl   KL(Q || P) = sum_v Q (l - t)                          (Gu et al. 2024, MiniLLM)
    jsd          JSD_b(P || Q) = b KL(P || M) + (1 - b) KL(Q || M),   M = b P + (1 - b) Q
                 the generalized JSD of GKD (Agarwal et al. 2024), P = teacher, Q = student,
                 b = `beta`. As b -> 0, JSD_b ~ b KL(P || Q) (forward KL, scaled); as b -> 1,
                 JSD_b ~ (1 - b) KL(Q || P) (reverse KL, scaled); at b = 0 or 1 it is 0.

    loss = sum_n [ (1 - ce_weight) T^2 D_n + ce_weight CE_n ]   ("mean": divided by the count)

where CE_n = -log softmax(x_n)[label_n] is the hard-label cross-entropy at temperature 1.
The T^2 factor (Hinton et al. 2015) keeps the divergence's gradient, which shrinks like 1/T^2
for large T, on the scale of the CE term, so `ce_weight` means the same at any temperature.
Metrics report the unscaled mean divergence.

Offline teacher (`teacher_topk` = (ids_NK, logps_NK), stored with the prepared data): the teacher
distribution is approximated by its top-k, renormalized: P_k = softmax_k(logps_k / T) (exactly the
temperature-T teacher restricted to those ids). The student term uses its true log-probs on those
ids, l_k = x_{id_k} / T - logsumexp_v(x_v / T), with the full log-normalizer. The divergences are
the formulas above summed over the k ids only: forward KL is then the cross-entropy of the
student under the truncated teacher minus its entropy (exact when the teacher's mass outside the
top-k is 0); reverse KL and JSD ignore the student's mass outside the teacher's top-k.

Memory. `_ChunkedDistill` drops ignored positions, then walks `chunk_tokens` positions at a time
for both models, keeping nothing but its inputs between forward and backward; backward recomputes
each chunk's logits and applies the closed-form gradient. With l = u - lse(u), u = x / T, and G =
dL/dl on the support (all V ids, or the k teacher ids),

    dL/du = scatter(G) - Q * sum(G)       dL/dx = dL/du / T

    forward_kl  G = -P
    reverse_kl  G = Q (l - t + 1)
    jsd         G = (1 - b) Q (l - log M)

Peak extra memory is three [chunk_tokens, V] fp32 blocks for forward_kl (student log-probs,
teacher log-probs, one product; four or five for jsd) plus the fp32 grad_weight accumulator,
independent of N. bench/distill_memory.py (CPU, 2,048 tokens, hidden 512, V = 151,936,
forward_kl): 774 MiB at chunk_tokens=256 and 2,106 MiB at 1,024, against 6,260 MiB for the
full-logits formula; the alternative design, the plain formula per chunk under
`torch.utils.checkpoint`, peaks at 1,155 / 3,663 MiB (autograd keeps every intermediate of the
recomputed chunk and a second [V, H] gradient) and is the slowest. For jsd at chunk_tokens=256:
775 MiB chunked, 1,748 checkpointed, 10,415 naive. The teacher gets no gradient.
`naive_distill_loss` is the full-logits formula, the reference for tests and benches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from posttrain.config.distill import KINDS
from posttrain.ops.cross_entropy import IGNORE_INDEX

__all__ = ["distill_loss", "naive_distill_loss"]

Kind = Literal["forward_kl", "reverse_kl", "jsd"]


def distill_loss(student_hidden_NH: torch.Tensor, student_weight_VH: torch.Tensor,
                 teacher_hidden_NH: torch.Tensor | None, teacher_weight_VH: torch.Tensor | None,
                 labels_N: torch.Tensor, *, kind: Kind = "forward_kl", beta: float = 0.5,
                 temperature: float = 1.0, ce_weight: float = 0.0,
                 real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                 teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                 reduction: Literal["mean", "sum"] = "mean",
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation loss of a student towards a teacher (formulas in the module docstring).

    Args:
        student_hidden_NH: [N, H_s] (or [B, T, H_s]) student final hidden states.
        student_weight_VH: [V_s_padded, H_s] student LM head.
        teacher_hidden_NH, teacher_weight_VH: the online teacher's hidden states [N, H_t] and
            head [V_t_padded, H_t]; None with `teacher_topk`. Both models share the tokenizer.
        labels_N: [N] (or [B, T]) shifted targets; -100 positions carry no loss and are dropped
            before any projection. Also the CE targets when `ce_weight` > 0.
        kind: "forward_kl" KL(teacher || student), "reverse_kl" KL(student || teacher), or
            "jsd" (generalized JSD with mixture weight `beta` on the teacher).
        beta: the JSD mixture weight, in (0, 1); only for kind "jsd".
        temperature: T > 0, divides both models' logits; the divergence is scaled by T^2.
        ce_weight: in [0, 1]; loss = (1 - ce_weight) T^2 D + ce_weight CE.
        real_vocab_size: rows of either head past it are vocabulary padding, never projected.
        chunk_tokens: positions per chunk; peak memory ~ a few chunk_tokens x V x 4 bytes.
        teacher_topk: offline teacher, (ids_NK int, logps_NK float) at temperature 1, the
            teacher's top-k ids and their log-probs per position (finite).
        reduction: "mean" over kept positions, or "sum" (divide by the step's global count).

    Returns:
        (loss, metrics): loss is an fp32 scalar (fp64 for fp64 inputs), differentiable in the
        student's hidden states and head only. metrics (detached scalars): ``divergence``
        (mean D_n, without T^2), ``ce`` (mean CE_n, only when ce_weight > 0) and ``tokens``
        (kept positions).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for kind 'jsd' (0 and 1 give a zero loss), "
                         f"got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    online = teacher_hidden_NH is not None or teacher_weight_VH is not None
    if online == (teacher_topk is not None) or (online and (teacher_hidden_NH is None
                                                            or teacher_weight_VH is None)):
        raise ValueError("give either teacher_hidden_NH and teacher_weight_VH (online teacher) "
                         "or teacher_topk (offline teacher), not both and not neither")

    hidden_NH = student_hidden_NH.reshape(-1, student_hidden_NH.shape[-1])
    labels_N = labels_N.reshape(-1)
    if hidden_NH.shape[0] != labels_N.shape[0] or student_hidden_NH.dim() not in (2, 3):
        raise ValueError(f"student_hidden_NH {tuple(student_hidden_NH.shape)} and labels_N "
                         f"{tuple(labels_N.shape)} must have the same leading shape")
    real = _real_vocab(student_weight_VH, real_vocab_size, "student_weight_VH")
    kept = (labels_N != IGNORE_INDEX).nonzero().squeeze(1)
    labels_K = labels_N.index_select(0, kept)
    _check_ids(labels_K, real, "labels_N")

    teacher_h = teacher_w = topk_ids = topk_logp = None
    if online:
        assert teacher_hidden_NH is not None and teacher_weight_VH is not None
        _real_vocab(teacher_weight_VH, real, "teacher_weight_VH")
        t_hidden = teacher_hidden_NH.reshape(-1, teacher_hidden_NH.shape[-1])
        if t_hidden.shape[0] != hidden_NH.shape[0]:
            raise ValueError(f"teacher_hidden_NH {tuple(teacher_hidden_NH.shape)} must have the "
                             f"student's positions {tuple(student_hidden_NH.shape[:-1])}")
        teacher_h = t_hidden.detach().index_select(0, kept)
        teacher_w = teacher_weight_VH.detach()
    else:
        assert teacher_topk is not None
        ids_NK, logps_NK = teacher_topk
        if ids_NK.shape != logps_NK.shape or ids_NK.reshape(-1, ids_NK.shape[-1]).shape[0] \
                != hidden_NH.shape[0]:
            raise ValueError(f"teacher_topk ids {tuple(ids_NK.shape)} and logps "
                             f"{tuple(logps_NK.shape)} must both be [N, K] with the student's "
                             f"N = {hidden_NH.shape[0]} positions")
        topk_ids = ids_NK.reshape(-1, ids_NK.shape[-1]).index_select(0, kept).long()
        _check_ids(topk_ids.reshape(-1), real, "teacher_topk ids")
        logps_KK = logps_NK.reshape(-1, logps_NK.shape[-1]).index_select(0, kept)
        logps_KK = logps_KK.to(_acc_dtype(hidden_NH))
        if not bool(torch.isfinite(logps_KK).all()):
            raise ValueError("teacher_topk log-probs must be finite at labelled positions (store "
                             "real top-k entries, not -inf padding)")
        topk_logp = torch.log_softmax(logps_KK.detach() / temperature, dim=-1)

    cfg = _Config(kind, float(beta), float(temperature), float(ce_weight), real,
                  _check_chunk(chunk_tokens))
    loss, div_sum, ce_sum = _ChunkedDistill.apply(hidden_NH.index_select(0, kept),
                                                  student_weight_VH, teacher_h, teacher_w,
                                                  topk_ids, topk_logp, labels_K, cfg)
    count = max(int(kept.numel()), 1)
    if reduction == "mean":
        loss = loss / count
    metrics = {"divergence": div_sum / count, "tokens": div_sum.new_tensor(float(kept.numel()))}
    if ce_weight > 0:
        metrics["ce"] = ce_sum / count
    return loss, metrics


def naive_distill_loss(student_hidden_NH: torch.Tensor, student_weight_VH: torch.Tensor,
                       teacher_hidden_NH: torch.Tensor, teacher_weight_VH: torch.Tensor,
                       labels_N: torch.Tensor, *, kind: Kind = "forward_kl", beta: float = 0.5,
                       temperature: float = 1.0, ce_weight: float = 0.0,
                       real_vocab_size: int | None = None) -> torch.Tensor:
    """Reference: full [N, V] fp32 logits for both models, the formulas by autograd, mean."""
    real = real_vocab_size or student_weight_VH.shape[0]
    keep_N = labels_N.reshape(-1) != IGNORE_INDEX
    h_s = student_hidden_NH.reshape(-1, student_hidden_NH.shape[-1])[keep_N]
    h_t = teacher_hidden_NH.reshape(-1, teacher_hidden_NH.shape[-1])[keep_N].detach()
    acc = _acc_dtype(h_s)
    x = F.linear(h_s, student_weight_VH[:real]).to(acc)
    with torch.no_grad():
        t = torch.log_softmax(F.linear(h_t, teacher_weight_VH.detach()[:real]).to(acc)
                              / temperature, dim=-1)
    s = torch.log_softmax(x / temperature, dim=-1)
    if kind == "forward_kl":
        div = (t.exp() * (t - s)).sum(-1)
    elif kind == "reverse_kl":
        div = (s.exp() * (s - t)).sum(-1)
    else:
        log_m = torch.logaddexp(t + math.log(beta), s + math.log(1 - beta))
        div = (beta * (t.exp() * (t - log_m)).sum(-1)
               + (1 - beta) * (s.exp() * (s - log_m)).sum(-1))
    loss = (1 - ce_weight) * temperature ** 2 * div
    if ce_weight > 0:
        loss = loss + ce_weight * F.cross_entropy(x, labels_N.reshape(-1)[keep_N],
                                                  reduction="none")
    return loss.sum() / max(int(keep_N.sum()), 1)


# --------------------------------------------------------------------------- the kernel


@dataclass(frozen=True)
class _Config:
    kind: str
    beta: float
    temperature: float
    ce_weight: float
    real: int
    chunk: int


class _ChunkedDistill(torch.autograd.Function):
    """(loss_sum, divergence_sum, ce_sum) over K kept positions, chunked; see the module doc."""

    @staticmethod
    def forward(ctx: Any, h_sKH: torch.Tensor, w_sVH: torch.Tensor, h_tKH: torch.Tensor | None,
                w_tVH: torch.Tensor | None, topk_ids_KK: torch.Tensor | None,
                topk_logp_KK: torch.Tensor | None, labels_K: torch.Tensor,
                cfg: _Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        totals = torch.zeros(3, dtype=torch.float64, device=h_sKH.device)
        for sl in _chunks(h_sKH.shape[0], cfg.chunk):
            parts = _chunk_values(h_sKH[sl], w_sVH, _at(h_tKH, sl), w_tVH,
                                  _at(topk_ids_KK, sl), _at(topk_logp_KK, sl), labels_K[sl], cfg)
            totals += torch.stack(parts).double()
        ctx.save_for_backward(h_sKH, w_sVH, h_tKH, w_tVH, topk_ids_KK, topk_logp_KK, labels_K)
        ctx.cfg = cfg
        loss, div, ce = (v.to(_acc_dtype(h_sKH)) for v in totals.unbind())
        ctx.mark_non_differentiable(div, ce)
        return loss, div, ce

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        h_sKH, w_sVH, h_tKH, w_tVH, topk_ids_KK, topk_logp_KK, labels_K = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h_sKH) if need_h else None
        acc = _acc_dtype(h_sKH)
        grad_w32 = (torch.zeros(w_sVH.shape, dtype=acc, device=w_sVH.device)
                    if need_w else None)
        w_real = w_sVH[:cfg.real]
        scale = grad_loss.to(acc)
        for sl in _chunks(h_sKH.shape[0], cfg.chunk):
            h_cH = h_sKH[sl]
            g_cV = _chunk_grad(h_cH, w_sVH, _at(h_tKH, sl), w_tVH, _at(topk_ids_KK, sl),
                               _at(topk_logp_KK, sl), labels_K[sl], cfg)
            g_low = g_cV.mul_(scale).to(h_sKH.dtype)
            if need_h:
                grad_h[sl] = g_low @ w_real
            if need_w:
                if g_low.dtype == acc:
                    grad_w32[:cfg.real].addmm_(g_low.T, h_cH)
                else:
                    grad_w32[:cfg.real] += (g_low.T @ h_cH).to(acc)
            del g_cV, g_low
        grad_w = grad_w32.to(w_sVH.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_values(h_cH: torch.Tensor, w_sVH: torch.Tensor, h_tcH: torch.Tensor | None,
                  w_tVH: torch.Tensor | None, ids_cK: torch.Tensor | None,
                  t_cK: torch.Tensor | None, labels_c: torch.Tensor,
                  cfg: _Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's (loss sum, divergence sum, CE sum)."""
    l_cV, _, ce_c, _ = _student_logprobs(h_cH, w_sVH, labels_c, cfg)
    t_cS, l_cS = _support(l_cV, h_tcH, w_tVH, ids_cK, t_cK, cfg)
    div = _divergence(l_cS, t_cS, cfg.kind, cfg.beta).sum()
    loss = (1.0 - cfg.ce_weight) * cfg.temperature ** 2 * div
    ce = ce_c.sum() if ce_c is not None else div.new_zeros(())
    return loss + cfg.ce_weight * ce, div, ce


def _chunk_grad(h_cH: torch.Tensor, w_sVH: torch.Tensor, h_tcH: torch.Tensor | None,
                w_tVH: torch.Tensor | None, ids_cK: torch.Tensor | None,
                t_cK: torch.Tensor | None, labels_c: torch.Tensor,
                cfg: _Config) -> torch.Tensor:
    """One chunk's d(loss sum)/dx [c, V], x the student's logits, built in place over l."""
    temp, alpha = cfg.temperature, cfg.ce_weight
    weight = (1.0 - alpha) * temp * temp
    l_cV, lse_u_c1, _, lse1_c = _student_logprobs(h_cH, w_sVH, labels_c, cfg)
    t_cS, l_cS = _support(l_cV, h_tcH, w_tVH, ids_cK, t_cK, cfg)
    G_cS = _divergence_grad(l_cS, t_cS, cfg.kind, cfg.beta)
    del t_cS
    # dL/du = scatter(G) - Q sum(G), u = x / T, so dL/dx = dL/du / T; times the T^2 weight.
    # CE: dCE/dx = softmax(x) - onehot(label); at T = 1 softmax(x) is Q itself.
    soft_cV = None
    q_coef_c1 = -G_cS.sum(-1, keepdim=True) * (weight / temp)
    if alpha > 0 and temp == 1.0:
        q_coef_c1 += alpha
    elif alpha > 0:
        assert lse1_c is not None
        # softmax(x) = exp(T (l + lse(u)) - lse(x)): x rebuilt from l.
        soft_cV = (l_cV * temp).add_(temp * lse_u_c1 - lse1_c[:, None]).exp_()
    g_cV = l_cV.exp_().mul_(q_coef_c1)
    G_cS.mul_(weight / temp)
    g_cV = g_cV.add_(G_cS) if ids_cK is None else g_cV.scatter_add_(1, ids_cK, G_cS)
    del G_cS
    if soft_cV is not None:
        g_cV.add_(soft_cV, alpha=alpha)
        del soft_cV
    if alpha > 0:
        g_cV.scatter_add_(1, labels_c[:, None], g_cV.new_full((g_cV.shape[0], 1), -alpha))
    return g_cV


def _student_logprobs(h_cH: torch.Tensor, w_sVH: torch.Tensor, labels_c: torch.Tensor,
                      cfg: _Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                             torch.Tensor | None]:
    """l = log softmax(x / T) [c, V] (built in place over the logits x), lse(x / T) [c, 1],
    and with a CE term the per-position CE and lse(x) [c]."""
    x_cV = F.linear(h_cH, w_sVH[:cfg.real]).to(_acc_dtype(h_cH))
    ce_c = lse1_c = None
    if cfg.ce_weight > 0:
        lse1_c = torch.logsumexp(x_cV, dim=-1)
        ce_c = lse1_c - x_cV.gather(1, labels_c[:, None]).squeeze(1)
    u_cV = x_cV.div_(cfg.temperature) if cfg.temperature != 1.0 else x_cV
    lse_u_c1 = torch.logsumexp(u_cV, dim=-1, keepdim=True)
    return u_cV.sub_(lse_u_c1), lse_u_c1, ce_c, lse1_c


@torch.no_grad()
def _support(l_cV: torch.Tensor, h_tcH: torch.Tensor | None, w_tVH: torch.Tensor | None,
             ids_cK: torch.Tensor | None, t_cK: torch.Tensor | None,
             cfg: _Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher log-probs t, student log-probs l) on the support: all V ids for an online
    teacher (t computed here), the teacher's k ids for an offline one. t is a fresh tensor
    (the divergence functions overwrite it)."""
    if ids_cK is not None:
        assert t_cK is not None
        return t_cK.clone(), l_cV.gather(1, ids_cK)
    assert h_tcH is not None and w_tVH is not None
    t_cV = F.linear(h_tcH, w_tVH[:cfg.real]).to(l_cV.dtype)
    if cfg.temperature != 1.0:
        t_cV.div_(cfg.temperature)
    return t_cV.sub_(torch.logsumexp(t_cV, dim=-1, keepdim=True)), l_cV


def _divergence(l_cS: torch.Tensor, t_cS: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """Per-position divergence [c] over the support (student log-probs l, teacher t); `t_cS` is
    overwritten. Differences first, then one dot product: no cancellation of two entropies."""
    if kind == "forward_kl":
        p_cS = t_cS.exp()
        return _rowdot(p_cS, t_cS.sub_(l_cS))
    if kind == "reverse_kl":
        return _rowdot(l_cS.exp(), t_cS.neg_().add_(l_cS))
    log_m_cS = _log_mixture(l_cS, t_cS, beta)
    p_cS = t_cS.exp()
    kl_p_c = _rowdot(p_cS, t_cS.sub_(log_m_cS))
    kl_q_c = _rowdot(torch.exp(l_cS, out=p_cS), log_m_cS.neg_().add_(l_cS))
    return beta * kl_p_c + (1.0 - beta) * kl_q_c


def _divergence_grad(l_cS: torch.Tensor, t_cS: torch.Tensor, kind: str,
                     beta: float) -> torch.Tensor:
    """G = dD/dl [c, S] (module docstring), built in place over `t_cS`."""
    if kind == "forward_kl":
        return t_cS.exp_().neg_()
    if kind == "reverse_kl":
        return t_cS.neg_().add_(l_cS).add_(1.0).mul_(l_cS.exp())
    log_q_cS = l_cS + math.log(1.0 - beta)
    log_m_cS = torch.logaddexp(t_cS.add_(math.log(beta)), log_q_cS, out=t_cS)
    del log_q_cS
    return log_m_cS.neg_().add_(l_cS).mul_(l_cS.exp()).mul_(1.0 - beta)


def _log_mixture(l_cS: torch.Tensor, t_cS: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = log(b P + (1 - b) Q), from the log-probs."""
    log_q_cS = l_cS + math.log(1.0 - beta)
    return torch.logaddexp(t_cS + math.log(beta), log_q_cS, out=log_q_cS)


def _rowdot(a_cS: torch.Tensor, b_cS: torch.Tensor) -> torch.Tensor:
    """sum_s a * b per row, as a batched matmul: no [c, S] temporary."""
    return torch.bmm(a_cS.unsqueeze(1), b_cS.unsqueeze(2)).view(-1)


# --------------------------------------------------------------------------- helpers


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 inputs, fp64 for fp64 (so references can be checked tightly)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, start + chunk) for start in range(0, n, chunk)]


def _at(t: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if t is None else t[sl]


def _real_vocab(weight: torch.Tensor, real_vocab_size: int | None, name: str) -> int:
    padded = weight.shape[0]
    if real_vocab_size is None:
        return padded
    if not 0 < real_vocab_size <= padded:
        raise ValueError(f"real_vocab_size {real_vocab_size} must be in [1, {padded}] "
                         f"({name} has {padded} rows)")
    return real_vocab_size


def _check_ids(ids: torch.Tensor, real: int, name: str) -> None:
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= real).any())):
        bad = ids[(ids < 0) | (ids >= real)][:5].tolist()
        raise ValueError(f"{name} must be token ids in [0, {real}) or -100; found {bad} (a "
                         f"padded vocabulary id or a wrong ignore index?)")


def _check_chunk(chunk_tokens: int) -> int:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return int(chunk_tokens)
