"""RMSNorm in fp32, `norm(x) * scale`, keeping x and its [..., 1] reciprocal root for backward.

Written as plain tensor ops (`x * rsqrt(mean(x ** 2) + eps) * w`), autograd keeps x twice
(for the square's and the product's gradients), the normalized x (for the scale's gradient)
and the root, and its backward makes eight tensors of x's size: the two products of each
multiplication, the mean's expanded gradient divided by the width, and the square's
`grad * (2 * x.pow(1))` in three steps. `rms_norm_scaled` keeps x and the root, forms the
normalized x again in the backward, and runs the same ops on the same values, writing most
results over tensors made for earlier ones: three new tensors of x's size in the backward
(four where the gradient's layout is not x's), one fewer in the forward, and one fewer kept
from the forward to the backward: on a CPU, fewer new tensors mostly means fewer fresh
pages (`posttrain.ops.gated` says why that pays).

Bitwise the same as autograd: each product is the same product (a multiplication commutes,
and multiplying by 2 or -0.5 is exact), each sum runs over a tensor of the layout autograd's
would have (the incoming gradient's), and x's two gradients reach autograd as two gradients,
in the order autograd's own graph delivers them (the product's, then the square's): x is
passed twice, so they are summed with whatever else x feeds (the residual stream) in the same
order as before.

Only fp32 x and scale take this path, outside compiled graphs; other dtypes cast around the
norm, and those casts are left to autograd (`models.layers.RMSNorm`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fusable", "rms_norm_scaled"]


def _root(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _ScaledRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_again: torch.Tensor, scale: torch.Tensor,
                eps: float) -> torch.Tensor:
        r = _root(x, eps)
        ctx.save_for_backward(x, r, scale)
        return (x * r).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, r, scale = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_scale = grad_x = grad_square = None
        buf = None                      # a free tensor of x's size in grad's layout
        if ctx.needs_input_grad[2]:
            normed = x * r
            if normed.stride() == grad.stride():
                buf = normed.mul_(grad)               # grad * normed
            else:
                buf = grad * normed
            grad_scale = buf.sum_to_size(scale.shape)
        if need_x:
            grad_normed = grad * scale
            if buf is None or buf.stride() != grad_normed.stride():
                buf = grad_normed * x
            else:
                torch.mul(grad_normed, x, out=buf)
            grad_r = buf.sum_to_size(r.shape)
            grad_x = grad_normed.mul_(r)
            # rsqrt's, the mean's and the square's backward, as autograd writes them
            grad_var = grad_r.mul(-0.5).mul_(r.pow(3))
            grad_square = torch.div(grad_var.expand(x.shape), x.shape[-1])
            grad_square.mul_(torch.mul(x, 2.0, out=buf))     # 2 * x.pow(1): exact
        return grad_x, grad_square, grad_scale, None


def fusable(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm_scaled(x, scale, eps)` applies: fp32 plain tensors (not DTensors), a
    1-D scale as wide as x's last dim, which is wider than one, outside torch.compile's graphs
    (Inductor fuses the plain expression into its own kernels)."""
    return (not torch.compiler.is_compiling() and x.dtype == torch.float32
            and scale.dtype == torch.float32 and scale.dim() == 1 and x.dim() >= 2
            and x.shape[-1] == scale.shape[0] > 1
            and not hasattr(x, "to_local") and not hasattr(scale, "to_local"))


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x ** 2, -1) + eps) * scale` for fp32 `x` and `scale` (the norm's weight,
    or Gemma's `1 + weight`), bitwise the plain expression's values and gradients with fewer
    tensors made and kept (module doc)."""
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad):
        return _ScaledRMSNorm.apply(x, x, scale, eps)
    return (x * _root(x, eps)).mul_(scale)
