"""The gated delta rule (`posttrain.ops.delta_rule`): the chunked form against the recurrent one
and against transformers' reference, packed rows against documents run alone (outputs, final
states, gradients), chunk-size invariance, and the restarting causal convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.delta_rule import (causal_conv, chunk_gated_delta_rule, gated_delta_rule,
                                      recurrent_gated_delta_rule)

HK, HV, DK, DV = 2, 4, 8, 6


def _inputs(B: int, T: int, seed: int = 0, dtype=torch.float64, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HK, DK, generator=gen, dtype=dtype)
    k = torch.randn(B, T, HK, DK, generator=gen, dtype=dtype)
    v = torch.randn(B, T, HV, DV, generator=gen, dtype=dtype)
    # decays between exp(-2) and 1 and write strengths in (0, 1): the state carries far
    g = -2 * torch.rand(B, T, HV, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("T,chunk", [(37, 8), (16, 16), (5, 64)])
def test_chunked_equals_recurrent(T: int, chunk: int) -> None:
    q, k, v, g, beta = _inputs(2, T)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(out_c, out_r, atol=1e-6, rtol=0)
    torch.testing.assert_close(state_c, state_r.to(state_c.dtype), atol=1e-6, rtol=0)
    # the recurrent form continues from a state exactly as one run over both halves
    half = T // 2
    a, state = recurrent_gated_delta_rule(*(x[:, :half] for x in (q, k, v, g, beta)))
    b, _ = recurrent_gated_delta_rule(*(x[:, half:] for x in (q, k, v, g, beta)),
                                      initial_state=state)
    torch.testing.assert_close(torch.cat([a, b], dim=1), out_r, atol=1e-6, rtol=0)


def test_matches_the_transformers_reference() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    q, k, v, g, beta = _inputs(2, 70, dtype=torch.float32)
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=64,
                                                  output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=2e-6, rtol=0)


def test_packed_rows_equal_documents_alone() -> None:
    """Documents that cross chunk boundaries, rows of different layouts; forward, the state
    after each row's last document, and every input gradient."""
    lengths = [[5, 11, 3, 13], [32]]
    q, k, v, g, beta = _inputs(2, 32, seed=1, grad=True)
    out, state = gated_delta_rule(q, k, v, g, beta, document_lengths=lengths, chunk_size=4,
                                  output_final_state=True)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                          dtype=out.dtype)
    (out * weights).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v, g, beta)]

    ref_grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            piece = [x[b:b + 1, start:start + n].detach().requires_grad_(True)
                     for x in (q, k, v, g, beta)]
            ref, ref_state = recurrent_gated_delta_rule(*piece)
            torch.testing.assert_close(out[b:b + 1, start:start + n], ref, atol=1e-6, rtol=0)
            (ref * weights[b:b + 1, start:start + n]).sum().backward()
            for acc, x in zip(ref_grads, piece):
                acc[b:b + 1, start:start + n] = x.grad
            start += n
        torch.testing.assert_close(state[b], ref_state[0].to(state.dtype), atol=1e-6, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_chunk_size_does_not_change_the_result() -> None:
    q, k, v, g, beta = _inputs(3, 50, seed=3)
    docs = [[50], [20, 30], [1, 48, 1]]
    outs = [gated_delta_rule(q, k, v, g, beta, document_lengths=docs, chunk_size=c)[0]
            for c in (1, 7, 64)]
    for out in outs[1:]:     # the rule runs in fp32 whatever the inputs
        torch.testing.assert_close(out, outs[0], atol=5e-6, rtol=0)


def test_causal_conv_restarts_at_documents_and_continues_from_history() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    docs = [[3, 9], [12]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    out = causal_conv(x, w, pos)
    for b, row in enumerate(docs):
        start = 0
        for n in row:
            piece = x[b:b + 1, start:start + n].transpose(1, 2)
            ref = F.conv1d(piece, w[:, None], padding=3, groups=5)[..., :n].transpose(1, 2)
            torch.testing.assert_close(out[b:b + 1, start:start + n], ref, atol=1e-12, rtol=0)
            start += n
    # decoding: the last K-1 inputs as history, one token at a time
    hist = x[1:, 5:8].transpose(1, 2)
    step = causal_conv(x[1:, 8:9], w, None, history_BCk=hist)
    torch.testing.assert_close(step, out[1:, 8:9], atol=1e-12, rtol=0)
