"""The gated unit of every gated MLP, `act(gate) * up`, keeping two tensors for backward.

Written as plain tensor ops, autograd keeps three [N, I] tensors per MLP until the backward:
`gate` (for the activation's gradient), `act(gate)` and `up` (for the product's). `gated`
keeps `gate` and `up` and computes `act(gate)` again in the backward, one elementwise pass
over a tensor the backward reads anyway. The gradients are the same ops on the same values
as autograd's (`grad * up`, `grad * act(gate)`, the activation's own backward kernel), so
they are bitwise the same; what changes is the memory. On a dense MLP that is a third of
the unit's saved activations: with Qwen3-0.6B's 3,072-wide MLP, 12 KiB per token and layer
in fp32.

Without gradients (generation, scoring, evaluation) it is the plain expression.

Each product is formed in the tensor the activation just wrote (`act(gate).mul_(up)`), and
the gate's gradient in the tensor `grad * up` just wrote (the activation's backward kernel
with `grad_input=` that tensor): the same ops on the same values, so bitwise the same, with
one new [N, I] tensor per result instead of two. On a CPU a new tensor of that size mostly
lands on pages the heap gave back (`posttrain.train.host_heap`), and an elementwise op that
writes fresh pages runs several times slower than one that rewrites the pages it just read
(a [8192, 768] fp32 product: 2.5 ms warm, 14-17 ms inside a training step on fresh pages).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "gated"]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_tanh_backward_(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=grad)


def _silu_backward_(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=grad)


# each activation by its config name (`hidden_act`), with the kernel autograd uses for its
# gradient, writing the input's gradient over `grad`: (forward, backward_(grad_out, input))
_KERNELS: dict[str, tuple[Callable, Callable]] = {
    "silu": (F.silu, _silu_backward_),
    "gelu_pytorch_tanh": (_gelu_tanh, _gelu_tanh_backward_),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_backward_),
}

# the activations by name, for the layers that apply one on its own
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    name: fwd for name, (fwd, _) in _KERNELS.items()}


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        ctx.save_for_backward(gate, up)
        return _KERNELS[name][0](gate).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gate, up = ctx.saved_tensors
        forward, backward_ = _KERNELS[ctx.name]
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = forward(gate).mul_(grad)          # grad * act(gate): a product commutes
        if ctx.needs_input_grad[0]:
            grad_gate = backward_(grad * up, gate)
        return grad_gate, grad_up, None


def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """`ACTIVATIONS[act](gate) * up`, saving `gate` and `up` for backward (when they have one
    shape and dtype; a broadcast or type-promoting product is left to autograd)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return _KERNELS[act][0](gate) * up
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _Gated.apply(gate, up, act)
    return _KERNELS[act][0](gate).mul_(up)
