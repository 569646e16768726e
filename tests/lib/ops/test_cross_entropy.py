"""Chunked cross-entropy and log-probs equal the full-logits formulas; padded ids get nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.cross_entropy import (chunked_argmax, chunked_cross_entropy, chunked_entropy,
                                         chunked_logprob_objective, chunked_logprobs,
                                         naive_cross_entropy, naive_logprobs)
from posttrain.ops import head_kernels
from posttrain.ops.vocab import mask_padded_logits, sample_next_token

TOL = dict(rtol=1e-6, atol=1e-6)
N, HIDDEN, PADDED, REAL = 53, 24, 96, 83


def make(seed=0, n=N, dtype=torch.float32, bias=False, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g, dtype=dtype).requires_grad_()
    weight = (0.3 * torch.randn(PADDED, HIDDEN, generator=g, dtype=dtype)).requires_grad_()
    b = (0.5 * torch.randn(PADDED, generator=g, dtype=dtype)).requires_grad_() if bias else None
    labels = torch.randint(0, REAL, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, b, labels


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 7, 16, 53, 1024])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_and_grads_match_naive(chunk, reduction):
    hidden, weight, _, labels = make()
    got = chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, chunk_tokens=chunk,
                                reduction=reduction)
    want = naive_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, reduction=reduction)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(grads(got, hidden, weight), grads(want, hidden, weight)):
        torch.testing.assert_close(a, b, **TOL)


def test_naive_reference_is_f_cross_entropy():
    hidden, weight, _, labels = make(ignore_every=0)
    want = F.cross_entropy(hidden @ weight[:REAL].T, labels)
    torch.testing.assert_close(naive_cross_entropy(hidden, weight, labels, real_vocab_size=REAL),
                               want, **TOL)


@pytest.mark.parametrize("softcap,bias", [(2.0, False), (None, True), (5.0, True)])
def test_softcap_and_bias(softcap, bias):
    hidden, weight, b, labels = make(seed=1, bias=bias)
    kw = dict(real_vocab_size=REAL, softcap=softcap, bias=b)
    got = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=10, **kw)
    want = naive_cross_entropy(hidden, weight, labels, **kw)
    torch.testing.assert_close(got, want, **TOL)
    for a, c in zip(grads(got, hidden, weight, b), grads(want, hidden, weight, b)):
        torch.testing.assert_close(a, c, **TOL)


def test_batched_input_with_all_ignored_rows():
    hidden, weight, _, labels = make(seed=2, n=4 * 13)
    hidden_BTH = hidden.detach().view(4, 13, HIDDEN).requires_grad_()
    labels_BT = labels.view(4, 13).clone()
    labels_BT[1] = -100
    labels_BT[3] = -100
    got = chunked_cross_entropy(hidden_BTH, weight, labels_BT, real_vocab_size=REAL, chunk_tokens=5)
    want = naive_cross_entropy(hidden_BTH, weight, labels_BT, real_vocab_size=REAL)
    torch.testing.assert_close(got, want, **TOL)
    g_got, g_want = grads(got, hidden_BTH, weight), grads(want, hidden_BTH, weight)
    for a, c in zip(g_got, g_want):
        torch.testing.assert_close(a, c, **TOL)
    assert g_got[0][1].abs().max() == 0 and g_got[0][3].abs().max() == 0


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_everything_ignored_gives_zero_loss_and_zero_grads(reduction):
    hidden, weight, _, labels = make(seed=3)
    labels[:] = -100
    loss = chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, reduction=reduction)
    assert loss.item() == 0.0
    g_hidden, g_weight = grads(loss, hidden, weight)
    assert g_hidden.abs().max() == 0 and g_weight.abs().max() == 0


def test_padded_rows_get_zero_probability_and_zero_gradient():
    hidden, weight, b, labels = make(seed=4, bias=True)
    loss = chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, bias=b,
                                 chunk_tokens=8, softcap=3.0)
    g_hidden, g_weight, g_bias = grads(loss, hidden, weight, b)
    assert g_weight[REAL:].abs().max() == 0 and g_bias[REAL:].abs().max() == 0
    assert g_weight[:REAL].abs().max() > 0
    # The padded rows do not change the loss, whatever they hold.
    with torch.no_grad():
        weight[REAL:] = 100.0
    again = chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, bias=b,
                                  chunk_tokens=8, softcap=3.0)
    torch.testing.assert_close(again, loss, **TOL)


def test_padded_label_is_rejected():
    hidden, weight, _, labels = make()
    labels[5] = REAL + 1
    with pytest.raises(ValueError, match="padded vocabulary"):
        chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL)


def test_frozen_head_gets_no_gradient():
    hidden, weight, _, labels = make(seed=5)
    frozen = weight.detach()
    loss = chunked_cross_entropy(hidden, frozen, labels, real_vocab_size=REAL, chunk_tokens=9)
    want = naive_cross_entropy(hidden, frozen, labels, real_vocab_size=REAL)
    torch.testing.assert_close(grads(loss, hidden)[0], grads(want, hidden)[0], **TOL)


def test_bfloat16_close_to_fp32_reference():
    hidden, weight, _, labels = make(seed=6)
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    got = chunked_cross_entropy(h16, w16, labels, real_vocab_size=REAL, chunk_tokens=16)
    want = naive_cross_entropy(h16.float(), w16.float(), labels, real_vocab_size=REAL)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    g_h, g_w = grads(got, h16, w16)
    assert g_h.dtype == g_w.dtype == torch.bfloat16


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (3.0, 1.0), (None, 0.7), (2.0, 1.3)])
@pytest.mark.parametrize("chunk", [6, 1024])
def test_logprobs_match_naive(softcap, temperature, chunk):
    hidden, weight, b, tokens = make(seed=7, bias=True)
    kw = dict(real_vocab_size=REAL, softcap=softcap, temperature=temperature, bias=b)
    got = chunked_logprobs(hidden, weight, tokens, chunk_tokens=chunk, **kw)
    want = naive_logprobs(hidden, weight, tokens, **kw)
    assert got.shape == tokens.shape and (got[tokens == -100] == 0).all()
    torch.testing.assert_close(got, want, **TOL)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(0))
    for a, c in zip(grads((got * upstream).sum(), hidden, weight, b),
                    grads((want * upstream).sum(), hidden, weight, b)):
        torch.testing.assert_close(a, c, **TOL)


def test_logprobs_keep_batch_shape():
    hidden, weight, _, tokens = make(seed=8, n=2 * 11)
    got = chunked_logprobs(hidden.view(2, 11, HIDDEN), weight, tokens.view(2, 11),
                           real_vocab_size=REAL, chunk_tokens=4)
    assert got.shape == (2, 11)
    torch.testing.assert_close(got.view(-1), naive_logprobs(hidden, weight, tokens,
                                                            real_vocab_size=REAL), **TOL)


def test_entropy_matches_full_softmax():
    hidden, weight, _, _ = make(seed=9)
    got = chunked_entropy(hidden, weight, real_vocab_size=REAL, chunk_tokens=10, softcap=4.0)
    logits = 4.0 * torch.tanh(hidden @ weight[:REAL].T / 4.0)
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_mask_padded_logits():
    logits = torch.randn(3, PADDED)
    masked = mask_padded_logits(logits, REAL)
    assert torch.isneginf(masked[:, REAL:]).all()
    assert torch.equal(masked[:, :REAL], logits[:, :REAL])
    assert mask_padded_logits(logits, PADDED) is logits


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, None), (2.0, 1.0, None),
                                                     (1.5, 0.9, None), (1.0, 1.0, 50)])
def test_sampling_never_picks_a_padded_id(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.zeros(64, PADDED)
    logits[:, REAL:] = 50.0  # padding rows that would win every draw if not masked
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([sample_next_token(logits + torch.randn(64, PADDED, generator=g), temperature,
                                       top_p, top_k, gen, real_vocab_size=REAL)
                     for _ in range(50)])
    assert ids.max() < REAL and ids.min() >= 0
    assert ids.unique().numel() > 40  # it does sample, not always the same id


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0, 0.0]]))
    gen = torch.Generator().manual_seed(0)
    draws = lambda **kw: torch.cat([sample_next_token(logits, generator=gen, real_vocab_size=4,
                                                      **kw) for _ in range(400)])
    assert set(draws(top_k=2).tolist()) == {0, 1}
    assert set(draws(top_p=0.75).tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert set(draws(top_p=0.85).tolist()) == {0, 1, 2}
    assert set(draws(top_p=0.1).tolist()) == {0}      # the top token always stays
    assert sample_next_token(logits[0], temperature=0.0).item() == 0
    assert draws().max().item() <= 3


def test_sampling_frequencies_match_the_probabilities():
    """200k draws from softmax(z / T) over 6 columns (one of probability 0): each frequency is
    within 4 standard errors of its probability; the zero column is never drawn."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    logits = torch.log(probs).expand(20_000, -1).contiguous()
    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([sample_next_token(logits, 0.5, generator=gen) for _ in range(10)])
    tempered = probs ** 2 / (probs ** 2).sum()               # T = 0.5
    freq = torch.bincount(ids, minlength=6).double() / ids.numel()
    se = (tempered * (1 - tempered) / ids.numel()).sqrt()
    assert freq[5] == 0
    assert torch.all((freq - tempered).abs() <= 4 * se + 1e-12), (freq, tempered)


def test_autograd_saves_no_logits():
    """Between forward and backward only inputs and per-token vectors are kept, never [N, V]."""
    hidden, weight, _, labels = make(seed=10)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    limit = max(hidden.numel(), weight.numel())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, chunk_tokens=8)
    assert max(saved) <= limit
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        naive_cross_entropy(hidden, weight, labels, real_vocab_size=REAL)
    assert max(saved) >= N * REAL > limit  # the check can tell the difference


@pytest.mark.parametrize("chunk", [1, 7, 1024])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_argmax_is_the_full_logits_argmax_over_the_real_vocabulary(chunk, softcap):
    hidden, weight, bias, _ = make(bias=True)
    with torch.no_grad():
        weight[REAL:] = 100.0                # padding rows would win if they were projected
        logits = mask_padded_logits(F.linear(hidden, weight, bias), REAL)
    got = chunked_argmax(hidden.view(1, N, HIDDEN), weight, real_vocab_size=REAL,
                         chunk_tokens=chunk, softcap=softcap, bias=bias)
    assert got.shape == (1, N) and got.dtype == torch.int64
    assert torch.equal(got[0], logits.argmax(dim=-1))


def count_projections(monkeypatch) -> list[int]:
    """The rows of every projection onto the vocabulary from now on, forward and backward
    (the kernels' `chunk_logits`, which the autograd engine also calls in backward)."""
    rows: list[int] = []
    project = head_kernels.chunk_logits

    def counting(h_cH, *args, **kwargs):
        rows.append(h_cH.shape[0])
        return project(h_cH, *args, **kwargs)

    monkeypatch.setattr(head_kernels, "chunk_logits", counting)
    return rows


def per_chunk(kept: int, chunk: int) -> list[int]:
    return [chunk] * (kept // chunk) + ([kept % chunk] if kept % chunk else [])


def test_scaled_loss_gradients_and_one_projection_per_chunk(monkeypatch):
    """The loss's gradients are formed in the forward pass and only scaled in backward: the
    head projects each chunk once (not again in backward), and an incoming gradient other than
    1 scales hidden, weight and bias gradients exactly like the reference's."""
    hidden, weight, b, labels = make(seed=11, bias=True)
    rows = count_projections(monkeypatch)
    got = chunked_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, chunk_tokens=8,
                                reduction="sum", bias=b)
    got_grads = grads(-3.5 * got, hidden, weight, b)
    kept = int((labels != -100).sum())
    assert rows == per_chunk(kept, 8)
    want = naive_cross_entropy(hidden, weight, labels, real_vocab_size=REAL, reduction="sum",
                               bias=b)
    torch.testing.assert_close(got, want, **TOL)
    for a, c in zip(got_grads, grads(-3.5 * want, hidden, weight, b)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (2.0, 0.7)])
def test_logprobs_with_entropy_from_the_same_logits(softcap, temperature):
    """`return_entropy` gives `chunked_entropy` at the projected positions (0 elsewhere) and
    leaves the log-probs and their gradients exactly as without it."""
    hidden, weight, _, labels = make(seed=12)
    kw = dict(real_vocab_size=REAL, chunk_tokens=8, softcap=softcap, temperature=temperature)
    logp, entropy = chunked_logprobs(hidden, weight, labels, return_entropy=True, **kw)
    plain = chunked_logprobs(hidden, weight, labels, **kw)
    assert torch.equal(logp, plain)
    keep = labels != -100
    want = chunked_entropy(hidden, weight, real_vocab_size=REAL, softcap=softcap,
                           temperature=temperature)
    torch.testing.assert_close(entropy[keep], want[keep], **TOL)
    assert torch.all(entropy[~keep] == 0) and not entropy.requires_grad
    for a, b in zip(grads(logp.sum(), hidden, weight), grads(plain.sum(), hidden, weight)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("softcap,temperature,chunk", [(None, 1.0, 8), (2.0, 0.7, 8),
                                                       (None, 1.3, 1024)])
def test_token_objective_gradients_in_one_projection_per_chunk(softcap, temperature, chunk,
                                                               monkeypatch):
    """A token-separable loss sum_n f_n(logp_n), nonlinear in each log-prob and with constants
    per position (a clipped ratio, as GRPO's): its value and its hidden, weight and bias
    gradients equal autograd through the full-logits log-probs, under an incoming gradient
    other than 1, with one projection per chunk; the log-probs and entropies it returns are
    `chunked_logprobs`' exactly."""
    hidden, weight, b, tokens = make(seed=13, bias=True)
    gen = torch.Generator().manual_seed(3)
    old = -3.0 * torch.rand(N, generator=gen)
    coef = torch.randn(N, generator=gen)

    def f(logp, old_n, coef_n):
        ratio = (logp - old_n).exp()
        return -torch.minimum(ratio * coef_n, ratio.clamp(0.8, 1.2) * coef_n) + 0.1 * logp ** 2

    kw = dict(real_vocab_size=REAL, softcap=softcap, temperature=temperature, bias=b)
    rows = count_projections(monkeypatch)
    loss, logp, entropy = chunked_logprob_objective(
        hidden, weight, tokens, lambda lp, pos: f(lp, old[pos], coef[pos]), chunk_tokens=chunk,
        return_entropy=True, **kw)
    got = grads(-2.5 * loss, hidden, weight, b)
    keep = tokens != -100
    assert rows == per_chunk(int(keep.sum()), chunk)
    monkeypatch.undo()
    full = naive_logprobs(hidden, weight, tokens, **kw)
    want_loss = f(full, old, coef)[keep].sum()
    torch.testing.assert_close(loss, want_loss, **TOL)
    for a, c in zip(got, grads(-2.5 * want_loss, hidden, weight, b)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    plain, plain_entropy = chunked_logprobs(hidden, weight, tokens, chunk_tokens=chunk,
                                            return_entropy=True, **kw)
    assert torch.equal(logp, plain.detach()) and torch.equal(entropy, plain_entropy)
    assert not logp.requires_grad and not entropy.requires_grad
