"""Document-masked attention equals per-document attention, built from transformers' own masks;
attention sinks against transformers' GPT-OSS eager formula."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (and_masks, causal_mask_function,
                                        packed_sequence_mask_function, sdpa_mask,
                                        sliding_window_causal_mask_function)

from posttrain.ops import attention as attention_module
from posttrain.ops.attention import attention, document_ids, reference_attention

TOL = dict(rtol=1e-5, atol=1e-5)
CPU_BACKENDS = ["split", "masked_sdpa"]


def hf_mask(lengths: list[list[int]], seq_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, T, T] bool mask from transformers' masking utilities (packed rows + causal/window)."""
    doc_ids = document_ids(lengths, len(lengths), seq_len)
    base = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(batch_size=len(lengths), q_length=seq_len, kv_length=seq_len,
                     mask_function=and_masks(base, packed_sequence_mask_function(doc_ids)),
                     allow_is_causal_skip=False)


def hf_eager(q, k, v, mask, scale, softcap, sinks=None):
    """transformers' eager attention (Gemma 3 style: scale, softcap, mask, softmax; GPT-OSS
    style with sinks: the sink is one more column of the scores, dropped after the softmax),
    in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def make_qkv(batch, heads, kv_heads, seq_len, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    return q, k, v


def check_against_hf(q, k, v, lengths, *, window=None, softcap=None, backend="auto",
                     scale=None, sinks=None):
    """Forward and grads w.r.t. q, k, v (and sinks) against the float64 transformers-mask
    reference."""
    seq_len = q.shape[2]
    out = attention(q, k, v, document_lengths=lengths, sliding_window=window, softcap=softcap,
                    scale=scale, backend=backend, sinks=sinks)
    grad_out = torch.randn_like(out)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad(out, inputs, grad_out)

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    rows = lengths if lengths is not None else [[seq_len]] * q.shape[0]
    scale64 = q.shape[-1] ** -0.5 if scale is None else scale
    ref = hf_eager(*inputs64[:3], hf_mask(rows, seq_len, window), scale64, softcap,
                   sinks=inputs64[3] if sinks is not None else None)
    ref_grads = torch.autograd.grad(ref, inputs64, grad_out.double())

    torch.testing.assert_close(out, ref.float(), **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), **TOL)


SPLITS = [[7, 1, 20, 12], [40], [1] * 5 + [35]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_packed_row_matches_per_document_attention(backend, heads, kv_heads):
    q, k, v = make_qkv(1, heads, kv_heads, 40)
    check_against_hf(q, k, v, [SPLITS[0]], backend=backend)


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "causal"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0)])
def test_value_head_dim_differs_from_query_key(backend, window, softcap):
    """Multi-head latent attention: values of 12 dims under queries / keys of 24, with GQA."""
    if backend == "causal" and (window or softcap):
        pytest.skip("the causal backend takes neither")
    q, k, _ = make_qkv(2, 4, 2, 40, head_dim=24, seed=5)
    v = torch.randn(2, 2, 40, 12, generator=torch.Generator().manual_seed(6), requires_grad=True)
    lengths = None if backend == "causal" else [SPLITS[0], [40]]
    check_against_hf(q, k, v, lengths, window=window, softcap=softcap, backend=backend,
                     scale=0.3)
    with pytest.raises(ValueError, match="Dv"):
        attention(q, k, v[:, :, :39])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rows_with_different_splits(backend):
    q, k, v = make_qkv(3, 4, 2, 40, seed=1)
    check_against_hf(q, k, v, SPLITS, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 8, 64])
def test_sliding_window_matches_transformers_mask(backend, window):
    q, k, v = make_qkv(2, 4, 2, 40, seed=2)
    check_against_hf(q, k, v, [SPLITS[0], SPLITS[2]], window=window, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
def test_softcap(backend, window):
    q, k, v = make_qkv(2, 4, 2, 40, seed=3)
    with torch.no_grad():
        q.mul_(4.0)  # large scores, so that the cap bites
    check_against_hf(q, k, v, [SPLITS[0], SPLITS[1]], window=window, softcap=2.0,
                     backend=backend, scale=0.3)


def make_sinks(heads, seed=0):
    """Sink logits around the size of the scores, so that they take a visible share."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=g) + 1.0).requires_grad_()


@pytest.mark.parametrize("backend", ["auto", *CPU_BACKENDS])
@pytest.mark.parametrize("lengths,window,softcap", [
    (None, None, None), ([SPLITS[0], SPLITS[2]], None, None), ([SPLITS[0], SPLITS[1]], 5, None),
    ([SPLITS[2], SPLITS[0]], 3, 2.0)], ids=["one-doc", "packed", "packed-window", "softcap"])
def test_sinks_match_transformers_eager(backend, lengths, window, softcap):
    """Forward and backward (q, k, v and the sinks) with one sink logit per query head, GQA."""
    q, k, v = make_qkv(2, 4, 2, 40, seed=7)
    check_against_hf(q, k, v, lengths, window=window, softcap=softcap, backend=backend,
                     sinks=make_sinks(4))


def test_sinks_with_a_prebuilt_causal_mask():
    """A model's mask built without `sinks=True` is plain causal; sinks still apply."""
    q, k, v = make_qkv(2, 4, 2, 24, seed=8)
    sinks = make_sinks(4, seed=1)
    mask = attention_module.build_mask(None, 2, 24, "cpu")
    assert mask.backend == "causal"
    got = attention(q, k, v, mask=mask, sinks=sinks)
    want = reference_attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(got, want, **TOL)
    assert attention_module.build_mask(None, 2, 24, "cpu", sinks=True).backend == "split"
    with pytest.raises(ValueError, match="one logit per query head"):
        attention(q, k, v, sinks=sinks[:2])


def test_window_of_one_sees_only_itself():
    q, k, v = make_qkv(1, 2, 2, 12)
    out = attention(q, k, v, document_lengths=[[5, 7]], sliding_window=1)
    torch.testing.assert_close(out, v.detach(), **TOL)


def test_single_document_is_plain_causal_sdpa():
    q, k, v = make_qkv(2, 4, 2, 33, seed=4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for lengths in (None, [[33], [33]]):
        for backend in ("auto", "split", "masked_sdpa"):
            got = attention(q, k, v, document_lengths=lengths, backend=backend)
            torch.testing.assert_close(got, want, **TOL)


def test_packed_row_differs_from_plain_causal():
    """Sanity: the document mask matters (a later document must not see an earlier one)."""
    q, k, v = make_qkv(1, 2, 2, 20)
    packed = attention(q, k, v, document_lengths=[[10, 10]])
    causal = attention(q, k, v)
    torch.testing.assert_close(packed[:, :, :10], causal[:, :, :10], **TOL)
    assert (packed[:, :, 10:] - causal[:, :, 10:]).abs().max() > 1e-3


@settings(max_examples=15, deadline=None, database=None)
@given(st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=6), min_size=1, max_size=3),
       st.sampled_from([None, 2, 5]), st.sampled_from([None, 1.5]))
def test_random_document_splits(rows, window, softcap):
    seq_len = max(sum(r) for r in rows)
    lengths = [r[:-1] + [r[-1] + seq_len - sum(r)] for r in rows]  # pad the last doc to T
    q, k, v = make_qkv(len(lengths), 4, 2, seq_len, head_dim=8, seed=seq_len)
    check_against_hf(q, k, v, lengths, window=window, softcap=softcap)


def test_module_reference_matches_transformers_mask():
    q, k, v = make_qkv(2, 4, 2, 40, seed=5)
    lengths = [SPLITS[0], SPLITS[2]]
    got = reference_attention(q, k, v, document_lengths=lengths, sliding_window=6, softcap=3.0)
    want = hf_eager(q.double(), k.double(), v.double(), hf_mask(lengths, 40, 6), 0.25, 3.0)
    torch.testing.assert_close(got, want.float(), **TOL)
    sinks = make_sinks(4).detach()
    got = reference_attention(q, k, v, document_lengths=lengths, sliding_window=6, sinks=sinks)
    want = hf_eager(q.double(), k.double(), v.double(), hf_mask(lengths, 40, 6), 0.25, None,
                    sinks=sinks.double())
    torch.testing.assert_close(got, want.float(), **TOL)


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False),
                                                  (None, 2.0, False), (3, 2.0, False),
                                                  (5, None, True)])
def test_flex_mask_and_score_mods_eager_forward(window, softcap, sinks):
    """The FlexAttention block mask and softcap score_mod, run eagerly on CPU (forward only:
    FlexAttention has no CPU backward in torch 2.13; the compiled path is tested on GPU)."""
    if not attention_module.flex_available():
        pytest.skip("no FlexAttention in this torch")
    q, k, v = (t.detach() for t in make_qkv(2, 4, 2, 40, seed=6))
    lengths = [SPLITS[0], SPLITS[2]]
    sink_logits = make_sinks(4).detach() if sinks else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = attention(q, k, v, document_lengths=lengths, sliding_window=window,
                        softcap=softcap, backend="flex", compile_flex=False, sinks=sink_logits)
    want = hf_eager(q.double(), k.double(), v.double(), hf_mask(lengths, 40, window), 0.25, softcap,
                    sinks=None if sink_logits is None else sink_logits.double())
    torch.testing.assert_close(got, want.float(), **TOL)


def test_auto_backend_choice():
    choose = attention_module._choose_backend
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose(cpu, None, 64, None, None) == "causal"
    assert choose(cpu, None, 64, 64, None) == "causal"
    assert choose(cpu, None, 64, 8, None) == "split"
    assert choose(cpu, [[32, 32]], 64, None, None) == "split"
    want_gpu = "flex" if attention_module.flex_available() else "masked_sdpa"
    assert choose(cuda, [[32, 32]], 64, None, 2.0) == want_gpu
    assert choose(cpu, None, 64, None, None, sinks=True) == "split"
    assert choose(cuda, None, 64, None, None, sinks=True) == want_gpu


@pytest.mark.parametrize("lengths,match", [([[10, 5]], "summing"), ([[20], [20]], "rows"),
                                           ([[0, 20]], "positive")])
def test_bad_document_lengths_are_named(lengths, match):
    q, k, v = make_qkv(1, 2, 2, 20)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, document_lengths=lengths)


def test_bad_head_counts():
    q, _, _ = make_qkv(1, 4, 4, 8)
    _, k, v = make_qkv(1, 3, 3, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (64, None, False),
                                                  (None, 20.0, False), (64, None, True)])
def test_flex_compiled_on_gpu(window, softcap, sinks):
    q, k, v = (t.detach().cuda().requires_grad_() for t in make_qkv(2, 8, 2, 512, head_dim=64))
    sink_logits = make_sinks(8).detach().cuda().requires_grad_() if sinks else None
    inputs = (q, k, v) if sink_logits is None else (q, k, v, sink_logits)
    lengths = [[100, 3, 300, 109], [512]]
    out = attention(q, k, v, document_lengths=lengths, sliding_window=window, softcap=softcap,
                    sinks=sink_logits)
    ref = reference_attention(q, k, v, document_lengths=lengths, sliding_window=window,
                              softcap=softcap, sinks=sink_logits)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad_out)
    want = torch.autograd.grad(ref, inputs, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unknown_backend():
    q, k, v = make_qkv(1, 2, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, backend="flash")
