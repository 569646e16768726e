"""The gated delta rule (`posttrain.ops.delta_rule`): the chunked form against the recurrent one
and against transformers' reference, packed rows against documents run alone (outputs, final
states, gradients), the two ways of passing the state between chunks (serial loop, scan) against
each other over many chunks with resets, chunk-size invariance, and the restarting causal
convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops import delta_rule
from posttrain.ops.delta_rule import (causal_conv, chunk_gated_delta_rule, gated_delta_rule,
                                      recurrent_gated_delta_rule)

HK, HV, DK, DV = 2, 4, 8, 6
FORMS = {"serial": 10 ** 9, "scan": 0}      # the _SERIAL_MAX_CHUNKS that selects each form


@pytest.fixture(params=list(FORMS))
def form(request, monkeypatch) -> str:
    """Run the test with the state passed by the serial loop and by the scan."""
    monkeypatch.setattr(delta_rule, "_SERIAL_MAX_CHUNKS", FORMS[request.param])
    return request.param


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


def test_packed_rows_equal_documents_alone(form: str) -> None:
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


def _documents_alone(inputs: list[torch.Tensor], starts: list[int], initial: torch.Tensor,
                     weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The recurrent form over each document of one row ([1, T, ...] inputs, documents
    starting at `starts`; tokens before the first start continue from `initial`, every
    document starts from zero): the output, the last document's final state, and the
    gradients of sum(out * weights) for the inputs and `initial`."""
    inputs = [x.detach().requires_grad_(True) for x in inputs]
    initial = initial.detach().requires_grad_(True)
    T = inputs[0].shape[1]
    bounds = sorted({0, *starts, T})
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        out, state = recurrent_gated_delta_rule(*(x[:, a:b] for x in inputs),
                                                initial_state=None if a in starts else initial)
        outs.append(out)
    out = torch.cat(outs, dim=1)
    (out * weights).sum().backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (*inputs, initial)]
    return out.detach(), state.detach(), grads


@pytest.mark.parametrize("resets", [[], [5, 6, 17, 36], [0, 9, 10, 36]])
def test_scan_equals_serial_over_many_chunks(resets: list[int], monkeypatch) -> None:
    """37 chunks (more than 32, not a power of two), an initial state, and documents starting
    at none of them, at chunks 5 and 6 (adjacent), 17 and 36 (the last chunk), or at chunk 0
    (the initial state is dropped), 9, 10 and 36: the scan, the serial loop and the recurrent
    form over each document give the same outputs, final state and gradients (inputs and
    initial state)."""
    chunk, N = 4, 37
    inputs = _inputs(1, N * chunk, seed=5)
    initial = torch.randn(1, HV, DK, DV, generator=torch.Generator().manual_seed(6))
    weights = torch.randn(1, N * chunk, HV, DV, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    reset = torch.zeros(1, N, dtype=torch.bool)
    reset[0, resets] = True
    want_out, want_state, want_grads = _documents_alone(inputs, [n * chunk for n in resets],
                                                        initial, weights)
    for form, max_chunks in FORMS.items():
        monkeypatch.setattr(delta_rule, "_SERIAL_MAX_CHUNKS", max_chunks)
        xs = [x.detach().requires_grad_(True) for x in (*inputs, initial)]
        out, state = chunk_gated_delta_rule(*xs[:5], chunk_size=chunk, initial_state=xs[5],
                                            reset_BN=reset)
        (out * weights).sum().backward()
        torch.testing.assert_close(out, want_out, atol=1e-6, rtol=0,
                                   msg=lambda m: f"{form}, out: {m}")
        torch.testing.assert_close(state, want_state, atol=1e-6, rtol=0,
                                   msg=lambda m: f"{form}, final state: {m}")
        for name, x, want in zip(("q", "k", "v", "g", "beta", "initial"), xs, want_grads):
            torch.testing.assert_close(x.grad, want.to(x.dtype), atol=1e-6, rtol=0,
                                       msg=lambda m: f"{form}, d{name}: {m}")
        _, none = chunk_gated_delta_rule(*inputs, chunk_size=chunk, initial_state=initial,
                                         reset_BN=reset, output_final_state=False)
        assert none is None


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
