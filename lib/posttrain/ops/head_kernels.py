"""The LM head's chunked autograd kernels behind `posttrain.ops.cross_entropy` (formulas and
the public functions there): `ChunkedTargetLogProb` keeps only the log-sum-exp between forward
and backward and projects each chunk again in backward; `ChunkedObjective` forms the
gradients of a token-separable loss in the forward, one projection per chunk.

Each call reuses its fp32 [chunk, V] logit blocks from chunk to chunk (`_LogitBlocks`). On a
CPU a fresh block of that size (32 MiB at 1,024 x 8,192) is its own memory mapping whose pages
are faulted in and zeroed again every chunk: projecting 8 chunks of 1,024 x 256 onto 8,192 rows
took 0.296 s with fresh blocks and 0.223 s reusing one (2 threads, medians of 8).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ChunkedObjective", "ChunkedTargetLogProb", "check_chunk", "chunk_logits"]


class _LogitBlocks:
    """Up to two fp32 [rows, V] blocks of one kernel call, allocated on first use and reused
    for every chunk (`index` 0: the logits, 1: the entropy's exp); None where the head's
    dtype is not fp32 (the logits are then cast to fp32 in a new tensor anyway)."""

    def __init__(self, hidden_KH: torch.Tensor, weight_VH: torch.Tensor, real: int, chunk: int):
        fp32 = hidden_KH.dtype == weight_VH.dtype == torch.float32
        self.shape = (min(chunk, hidden_KH.shape[0]), real) if fp32 else None
        self.device = hidden_KH.device
        self.blocks: list[torch.Tensor | None] = [None, None]

    def get(self, index: int, rows: int) -> torch.Tensor | None:
        if self.shape is None:
            return None
        if self.blocks[index] is None:
            self.blocks[index] = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return self.blocks[index][:rows]


class ChunkedTargetLogProb(torch.autograd.Function):
    """logp_K = log_softmax(z)[target] for K kept positions, chunked; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, hidden_KH: torch.Tensor, weight_VH: torch.Tensor,
                bias_V: torch.Tensor | None, targets_K: torch.Tensor, real: int, chunk_tokens: int,
                softcap: float | None, temperature: float, return_entropy: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        chunk = check_chunk(chunk_tokens)
        lse_K = hidden_KH.new_empty(hidden_KH.shape[0], dtype=torch.float32)
        logp_K = torch.empty_like(lse_K)
        entropy_K = torch.empty_like(lse_K) if return_entropy else None
        blocks = _LogitBlocks(hidden_KH, weight_VH, real, chunk)
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            h_cH = hidden_KH[sl]
            z_cV, _ = chunk_logits(h_cH, weight_VH, bias_V, real, softcap, temperature,
                                   out=blocks.get(0, h_cH.shape[0]))
            target_c = z_cV.gather(1, targets_K[sl, None]).squeeze(1)
            max_c = z_cV.amax(dim=-1)
            shifted_cV = z_cV.sub_(max_c[:, None])
            if entropy_K is None:
                # logsumexp in place: torch.logsumexp would hold a second [chunk, V] block.
                lse_K[sl] = shifted_cV.exp_().sum(dim=-1).log_().add_(max_c)
            else:
                # H = log S - sum_v e_v (z_v - max) / S with e = exp(z - max), S = sum_v e_v
                e_cV = _exp(shifted_cV, blocks.get(1, h_cH.shape[0]))
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
        blocks = _LogitBlocks(hidden_KH, weight_VH, real, chunk)
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            h_cH = hidden_KH[sl]
            z_cV, tanh_cV = chunk_logits(h_cH, weight_VH, bias_V, real, softcap, temperature,
                                         want_tanh=True, out=blocks.get(0, h_cH.shape[0]))
            # d logp / d z = onehot(y) - p, scaled by the incoming gradient; built in place.
            g_cV = z_cV.sub_(lse_K[sl, None]).exp_()
            g_cV.scatter_add_(1, targets_K[sl, None], g_cV.new_full((g_cV.shape[0], 1), -1.0))
            g_cV.mul_(-grad_logp_K[sl, None])
            if temperature != 1.0:
                g_cV.div_(temperature)
            if tanh_cV is not None:
                g_cV.mul_(tanh_cV.square_().neg_().add_(1.0))  # d/dx c*tanh(x/c) = 1 - tanh^2
            grads.add(sl, g_cV, h_cH, real)
            del z_cV, tanh_cV, g_cV
        grad_h, grad_w, grad_b = grads.done()
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


class ChunkedObjective(torch.autograd.Function):
    """loss = sum_K f_K(logp_K), with the gradients computed in the forward pass.

    f is `objective` (see `chunked_logprob_objective`), or with None the cross-entropy
    f_K = -logp_K. A scalar loss has one incoming gradient for all positions, so d loss / d
    hidden and d loss / d weight can be formed chunk by chunk while each chunk's logits are at
    hand, and backward only scales them: the logits are projected once instead of twice
    (forward, then recomputed in backward), which saves a third of the LM head's matmul FLOPs.
    Extra memory until backward: grad_hidden [K, H] (it replaces the saved hidden) and the fp32
    grad_weight accumulator, which the backward of `ChunkedTargetLogProb` allocates anyway.
    Returns (loss, logp_K, entropy_K); the last two are not differentiable, and empty unless
    an objective is given or the entropy asked for.
    """

    @staticmethod
    def forward(ctx: Any, hidden_KH: torch.Tensor, weight_VH: torch.Tensor,
                bias_V: torch.Tensor | None, targets_K: torch.Tensor, real: int,
                chunk_tokens: int, softcap: float | None, temperature: float,
                objective: Any, return_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk = check_chunk(chunk_tokens)
        grads = _GradSums(hidden_KH, weight_VH, bias_V, need_h, need_w, need_b)
        loss = torch.zeros((), dtype=torch.float64, device=hidden_KH.device)
        n = hidden_KH.shape[0] if objective is not None else 0
        logp_K = hidden_KH.new_empty(n, dtype=torch.float32)
        entropy_K = hidden_KH.new_empty(hidden_KH.shape[0] if return_entropy else 0,
                                        dtype=torch.float32)
        blocks = _LogitBlocks(hidden_KH, weight_VH, real, chunk)
        for start in range(0, hidden_KH.shape[0], chunk):
            sl = slice(start, start + chunk)
            h_cH = hidden_KH[sl]
            z_cV, tanh_cV = chunk_logits(h_cH, weight_VH, bias_V, real, softcap, temperature,
                                         want_tanh=grads.any, out=blocks.get(0, h_cH.shape[0]))
            target_c = z_cV.gather(1, targets_K[sl, None]).squeeze(1)
            max_c = z_cV.amax(dim=-1)
            shifted_cV = z_cV.sub_(max_c[:, None])
            if return_entropy:
                # H = log S - sum_v e_v (z_v - max) / S with e = exp(z - max), S = sum_v e_v
                p_cV = _exp(shifted_cV, blocks.get(1, h_cH.shape[0]))
                sum_c = p_cV.sum(dim=-1)
                log_sum_c = sum_c.log()
                entropy_K[sl] = log_sum_c - shifted_cV.mul_(p_cV).sum(dim=-1) / log_sum_c.exp()
            else:
                # exp(z - max) in place: the unnormalised softmax, then lse; no second block
                p_cV = shifted_cV.exp_()
                sum_c = p_cV.sum(dim=-1)
            lse_c = sum_c.log().add_(max_c)
            scale_c = None                  # -d f / d logp per position; None: 1 (cross-entropy)
            if objective is None:
                loss += (lse_c - target_c).sum(dtype=torch.float64)
            else:
                logp_c = logp_K[sl] = target_c - lse_c
                f_c, scale_c = _terms_and_slopes(objective, logp_c, sl, grads.any)
                loss += f_c.sum(dtype=torch.float64)
            if grads.any:
                # d f / dz = -(d f / d logp) (onehot(y) - p) = scale (p - onehot(y))
                g_cV = p_cV.div_(sum_c[:, None])
                g_cV.scatter_add_(1, targets_K[sl, None], g_cV.new_full((g_cV.shape[0], 1), -1.0))
                if scale_c is not None:
                    g_cV.mul_(scale_c[:, None])
                if temperature != 1.0:
                    g_cV.div_(temperature)
                if tanh_cV is not None:
                    g_cV.mul_(tanh_cV.square_().neg_().add_(1.0))
                grads.add(sl, g_cV, h_cH, real)
                del g_cV        # p_cV's buffer: the next chunk's block, or freed first
            del z_cV, tanh_cV, p_cV, shifted_cV
        ctx.grads = grads.done() if grads.any else None
        ctx.mark_non_differentiable(logp_K, entropy_K)
        return loss.float(), logp_K, entropy_K

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        scale = grad_loss.float()

        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.mul_(scale.to(g.dtype))

        return scaled(grad_h), scaled(grad_w), scaled(grad_b), *(None,) * 7


def _terms_and_slopes(objective: Any, logp_c: torch.Tensor, rows: slice,
                      want_slopes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's loss terms f(logp_c) (detached) and -d f / d logp_c, by autograd over the
    objective alone (a few elementwise ops per position)."""
    with torch.enable_grad():
        logp = logp_c.detach().requires_grad_(want_slopes)
        f_c = objective(logp, rows)
        if f_c.shape != logp.shape:
            raise ValueError(f"the objective must return one term per log-prob, shape "
                             f"{tuple(logp.shape)}; got {tuple(f_c.shape)}")
        if not want_slopes:
            return f_c.detach(), None
        if not f_c.requires_grad:          # no term depends on its log-prob
            return f_c.detach(), torch.zeros_like(logp_c)
        (slope_c,) = torch.autograd.grad(f_c.sum(), logp, allow_unused=True)
    if slope_c is None:
        slope_c = torch.zeros_like(logp_c)
    return f_c.detach(), slope_c.float().neg_()


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


def chunk_logits(h_cH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                 real: int, softcap: float | None, temperature: float, *,
                 want_tanh: bool = False, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z = softcap(h W[:real].T + b[:real]) / temperature in fp32, and, with `want_tanh` and a
    softcap, tanh(x / softcap) for the softcap derivative (a second [chunk, V] block). `out`:
    an fp32 [chunk, real] block to project into (fp32 head only), else a new tensor."""
    bias = None if bias_V is None else bias_V[:real]
    if out is None:
        z_cV = F.linear(h_cH, weight_VH[:real], bias).float()
    elif bias is None:
        z_cV = torch.mm(h_cH, weight_VH[:real].T, out=out)
    else:
        z_cV = torch.addmm(bias, h_cH, weight_VH[:real].T, out=out)
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



def _exp(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return x.exp() if out is None else torch.exp(x, out=out)


def check_chunk(chunk_tokens: int) -> int:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return int(chunk_tokens)
