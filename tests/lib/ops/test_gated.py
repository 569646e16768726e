"""`ops.gated`: the gated unit's values and gradients are bitwise autograd's; it keeps two of
the three [N, I] tensors autograd would keep."""

import pytest
import torch

from posttrain.ops.gated import ACTIVATIONS, gated


def _saved_bytes(fn, *inputs) -> tuple[torch.Tensor, int]:
    """fn(*inputs) and the bytes of the distinct storages autograd keeps for its backward,
    the inputs' own included."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(storages.values())


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("needs", ["both", "gate", "up"])
def test_values_and_gradients_are_autograds_bitwise(act, dtype, needs):
    gen = torch.Generator().manual_seed(0)
    gate0, up0, grad = (torch.randn(3, 37, 48, generator=gen).to(dtype) * 3 for _ in range(3))

    def leaves():
        return (gate0.clone().requires_grad_(needs in ("both", "gate")),
                up0.clone().requires_grad_(needs in ("both", "up")))

    g_ref, u_ref = leaves()
    ref = ACTIVATIONS[act](g_ref) * u_ref
    ref.backward(grad)
    g, u = leaves()
    out = gated(g, u, act)
    assert out.grad_fn is not None and "Gated" in type(out.grad_fn).__name__
    out.backward(grad)
    assert torch.equal(out, ref)
    for mine, theirs in ((g.grad, g_ref.grad), (u.grad, u_ref.grad)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert torch.equal(mine, theirs)


def test_keeps_gate_and_up_where_autograd_keeps_act_gate_too():
    gate = torch.randn(64, 96, requires_grad=True)
    up = torch.randn(64, 96, requires_grad=True)
    one = 64 * 96 * 4
    _, plain = _saved_bytes(lambda g, u: ACTIVATIONS["silu"](g) * u, gate, up)
    out, mine = _saved_bytes(gated, gate, up, "silu")
    assert (plain, mine) == (3 * one, 2 * one)
    with torch.no_grad():       # generation and scoring: the plain expression, no graph
        assert gated(gate, up, "silu").grad_fn is None
    # a broadcast product is left to autograd (its gradient sums over the broadcast dims)
    row = torch.randn(1, 96, requires_grad=True)
    assert "Mul" in type(gated(gate, row, "silu").grad_fn).__name__
