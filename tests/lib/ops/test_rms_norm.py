"""`ops.rms_norm`: the fp32 norm's values and gradients are bitwise autograd's on the plain
expression (`models.layers.RMSNorm` without it), x's own gradient included where x also feeds
the residual stream; it keeps x and the root where autograd also keeps the normalized x."""

import pytest
import torch

from posttrain.models.layers import RMSNorm
from posttrain.ops.rms_norm import fusable, rms_norm_scaled

EPS = 1e-6


def _plain(x: torch.Tensor, weight: torch.Tensor, offset: bool) -> torch.Tensor:
    # models.layers.RMSNorm's expression for fp32 (the casts are no-ops there)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return normed * (1.0 + weight) if offset else weight * normed


def _grads(norm, x0, w0, grad, *, needs, residual):
    x = x0.clone().requires_grad_(needs in ("both", "x"))
    w = w0.clone().requires_grad_(needs in ("both", "weight"))
    h = x * 1.5                          # x's gradient then reaches the leaf through a node
    y = norm(h, w)
    out = y + h if residual else y       # x also feeds the residual stream
    if grad is None:
        out.sum().backward()             # an expanded (stride-0) gradient
    else:
        out.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("needs", ["both", "x", "weight"])
@pytest.mark.parametrize("layout", ["contiguous", "heads", "expanded"])
def test_values_and_gradients_are_autograds_bitwise(offset, needs, layout):
    gen = torch.Generator().manual_seed(0)
    shape = (1, 50, 4, 64) if layout == "heads" else (2, 37, 48)
    x0 = torch.randn(*shape, generator=gen) * 3
    w0 = torch.randn(shape[-1], generator=gen) * 0.5 + (0.0 if offset else 1.0)
    grad = None
    if layout == "contiguous":
        grad = torch.randn(*shape, generator=gen)
    elif layout == "heads":             # q/k norms: the gradient comes back through a transpose
        grad = torch.randn(1, 4, 50, 64, generator=gen).transpose(1, 2)

    def fused(h, w):
        scale = 1.0 + w if offset else w
        assert fusable(h, scale)
        return rms_norm_scaled(h, scale, EPS)

    for residual in (False, True):
        ref = _grads(lambda h, w: _plain(h, w, offset), x0, w0, grad, needs=needs,
                     residual=residual)
        mine = _grads(fused, x0, w0, grad, needs=needs, residual=residual)
        for a, b in zip(mine, ref):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)


def test_keeps_x_and_the_root_where_autograd_also_keeps_the_normalized_x():
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def kept(fn) -> int:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, w)
        return sum(saved.values())

    one, root, weight = 64 * 96 * 4, 64 * 4, 96 * 4
    assert kept(lambda x, w: _plain(x, w, False)) == 2 * one + root + weight
    assert kept(lambda x, w: rms_norm_scaled(x, w, EPS)) == one + root + weight


def test_the_module_takes_it_for_fp32_only():
    norm = RMSNorm(48)
    x = torch.randn(3, 48, requires_grad=True)
    assert "ScaledRMSNorm" in type(norm(x).grad_fn).__name__
    with torch.no_grad():               # generation and scoring: no graph, the same values
        assert norm(x).grad_fn is None
        assert torch.equal(norm(x), _plain(x, norm.weight, False))
    # bf16 casts around the norm; autograd keeps those
    assert "ScaledRMSNorm" not in type(norm.to(torch.bfloat16)(x.bfloat16()).grad_fn).__name__


def test_qwen3_5_gated_norm_is_its_plain_expression_bitwise(monkeypatch):
    import posttrain.models.deltanet as deltanet
    gen = torch.Generator().manual_seed(1)
    x0, gate0 = (torch.randn(2, 9, 4, 32, generator=gen) for _ in range(2))
    norm = deltanet.GatedRMSNorm(32, EPS)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=gen)

    def run():
        norm.zero_grad()
        x, gate = x0.clone().requires_grad_(), gate0.clone().requires_grad_()
        out = norm(x, gate)
        out.backward(torch.ones_like(out).cumsum(-1))
        return out.detach(), x.grad, gate.grad, norm.weight.grad.clone()

    mine = run()
    import posttrain.models.layers as layers
    monkeypatch.setattr(layers, "fusable", lambda *a: False)
    for a, b in zip(mine, run()):
        assert torch.equal(a, b)
