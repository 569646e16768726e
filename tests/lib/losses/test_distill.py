"""Chunked distillation equals the full-logits formulas (online and top-k teachers), grads too."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.losses.distill import distill_loss, naive_distill_loss

TIGHT = dict(rtol=1e-10, atol=1e-12)
N, H_S, H_T, PADDED, REAL = 45, 16, 20, 72, 61


def make(seed=0, dtype=torch.float64, n=N, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, H_S, generator=g, dtype=dtype).requires_grad_()
    w_s = (0.4 * torch.randn(PADDED, H_S, generator=g, dtype=dtype)).requires_grad_()
    h_t = torch.randn(n, H_T, generator=g, dtype=dtype)
    w_t = 0.4 * torch.randn(PADDED + 8, H_T, generator=g, dtype=dtype)
    labels = torch.randint(0, REAL, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return h_s, w_s, h_t, w_t, labels


def divergence(kind, P, Q, beta):
    """Per-row D(P = teacher, Q = student) over the last axis, straight from the definitions."""
    if kind == "forward_kl":
        return (P * (P.log() - Q.log())).sum(-1)
    if kind == "reverse_kl":
        return (Q * (Q.log() - P.log())).sum(-1)
    M = beta * P + (1 - beta) * Q
    return beta * (P * (P / M).log()).sum(-1) + (1 - beta) * (Q * (Q / M).log()).sum(-1)


def reference(h_s, w_s, h_t, w_t, labels, *, kind, beta=0.5, temperature=1.0, ce_weight=0.0):
    keep = labels != -100
    x = h_s[keep] @ w_s[:REAL].T
    Q = torch.softmax(x / temperature, -1)
    P = torch.softmax(h_t[keep] @ w_t[:REAL].T / temperature, -1)
    per = (1 - ce_weight) * temperature ** 2 * divergence(kind, P, Q, beta)
    per = per + ce_weight * -torch.log_softmax(x, -1).gather(1, labels[keep, None]).squeeze(1)
    return per.mean()


def topk_reference(h_s, w_s, ids, logps, labels, *, kind, beta=0.5, temperature=1.0):
    """Teacher renormalized on its top-k; student's true probabilities on those ids."""
    keep = labels != -100
    P = torch.softmax(logps[keep] / temperature, -1)
    Q = torch.softmax(h_s[keep] @ w_s[:REAL].T / temperature, -1).gather(1, ids[keep])
    return divergence(kind, P, Q, beta).mean() * temperature ** 2


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors, retain_graph=True)


def assert_same(got, want, inputs, tol):
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(grads(got, *inputs), grads(want, *inputs)):
        torch.testing.assert_close(a, b, **tol)


CASES = [(1.0, 0.0), (2.0, 0.0), (0.7, 0.3), (1.0, 1.0)]


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature,ce_weight", CASES)
def test_matches_reference(kind, temperature, ce_weight):
    h_s, w_s, h_t, w_t, labels = make(seed=1)
    kw = dict(kind=kind, beta=0.3, temperature=temperature, ce_weight=ce_weight)
    got, metrics = distill_loss(h_s, w_s, h_t, w_t, labels, real_vocab_size=REAL,
                                chunk_tokens=7, **kw)
    assert_same(got, reference(h_s, w_s, h_t, w_t, labels, **kw), (h_s, w_s), TIGHT)
    assert ("ce" in metrics) == (ce_weight > 0) and metrics["tokens"].item() == 33


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_fp32_matches_reference_and_naive(kind):
    h_s, w_s, h_t, w_t, labels = make(seed=2, dtype=torch.float32)
    kw = dict(kind=kind, temperature=1.5, ce_weight=0.2)
    got, _ = distill_loss(h_s, w_s, h_t, w_t, labels, real_vocab_size=REAL, chunk_tokens=10, **kw)
    assert got.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6)
    assert_same(got, reference(h_s, w_s, h_t, w_t, labels, **kw), (h_s, w_s), tol)
    assert_same(got, naive_distill_loss(h_s, w_s, h_t, w_t, labels, real_vocab_size=REAL, **kw),
                (h_s, w_s), tol)


@pytest.mark.parametrize("chunk", [1, 13, 1000])
def test_chunk_size_and_batched_shape_do_not_matter(chunk):
    h_s, w_s, h_t, w_t, labels = make(seed=3, n=5 * 9)
    want = reference(h_s, w_s, h_t, w_t, labels, kind="jsd", temperature=1.3)
    got, _ = distill_loss(h_s.view(5, 9, H_S), w_s, h_t.view(5, 9, H_T), w_t, labels.view(5, 9),
                          kind="jsd", temperature=1.3, real_vocab_size=REAL, chunk_tokens=chunk)
    assert_same(got, want, (h_s, w_s), TIGHT)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_topk_matches_reference(kind, temperature):
    h_s, w_s, h_t, w_t, labels = make(seed=4)
    logps_full = torch.log_softmax(h_t @ w_t[:REAL].T, -1)
    logps, ids = logps_full.topk(8, dim=-1)
    got, _ = distill_loss(h_s, w_s, None, None, labels, kind=kind, beta=0.6,
                          temperature=temperature, real_vocab_size=REAL, chunk_tokens=6,
                          teacher_topk=(ids, logps))
    want = topk_reference(h_s, w_s, ids, logps, labels, kind=kind, beta=0.6,
                          temperature=temperature)
    assert_same(got, want, (h_s, w_s), TIGHT)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_over_the_whole_vocabulary_is_the_online_loss(kind):
    h_s, w_s, h_t, w_t, labels = make(seed=5)
    logps, ids = torch.log_softmax(h_t @ w_t[:REAL].T, -1).topk(REAL, dim=-1)
    kw = dict(kind=kind, temperature=1.4, ce_weight=0.25, real_vocab_size=REAL, chunk_tokens=9)
    offline, _ = distill_loss(h_s, w_s, None, None, labels, teacher_topk=(ids, logps), **kw)
    online, _ = distill_loss(h_s, w_s, h_t, w_t, labels, **kw)
    assert_same(offline, online, (h_s, w_s), TIGHT)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_identical_models_have_zero_forward_kl_and_zero_gradient(temperature):
    h_s, w_s, _, _, labels = make(seed=6)
    loss, metrics = distill_loss(h_s, w_s, h_s.detach(), w_s.detach(), labels,
                                 temperature=temperature, real_vocab_size=REAL, chunk_tokens=8)
    assert abs(loss.item()) < 1e-12 and abs(metrics["divergence"].item()) < 1e-12
    for g in grads(loss, h_s, w_s):
        assert g.abs().max().item() < 1e-12


def test_jsd_limits_are_scaled_forward_and_reverse_kl():
    h_s, w_s, h_t, w_t, labels = make(seed=7)
    kw = dict(real_vocab_size=REAL, chunk_tokens=16)
    fwd = distill_loss(h_s, w_s, h_t, w_t, labels, kind="forward_kl", **kw)[0].item()
    rev = distill_loss(h_s, w_s, h_t, w_t, labels, kind="reverse_kl", **kw)[0].item()
    b = 1e-9  # the next order is ~ b * max(P/Q or Q/P): small enough for these logits
    small = distill_loss(h_s, w_s, h_t, w_t, labels, kind="jsd", beta=b, **kw)[0].item()
    large = distill_loss(h_s, w_s, h_t, w_t, labels, kind="jsd", beta=1 - b, **kw)[0].item()
    assert small / b == pytest.approx(fwd, rel=1e-5)
    assert large / (1 - (1 - b)) == pytest.approx(rev, rel=1e-5)


def test_teacher_and_padded_rows_get_no_gradient():
    h_s, w_s, h_t, w_t, labels = make(seed=8)
    h_t.requires_grad_()
    w_t.requires_grad_()
    loss, _ = distill_loss(h_s, w_s, h_t, w_t, labels, kind="reverse_kl", ce_weight=0.5,
                           real_vocab_size=REAL, chunk_tokens=5)
    loss.backward()
    assert h_t.grad is None and w_t.grad is None
    assert w_s.grad[REAL:].abs().max() == 0 and w_s.grad[:REAL].abs().max() > 0
    assert h_s.grad[labels == -100].abs().max() == 0


def test_everything_ignored_and_sum_reduction():
    h_s, w_s, h_t, w_t, labels = make(seed=9)
    empty = torch.full_like(labels, -100)
    loss, _ = distill_loss(h_s, w_s, h_t, w_t, empty, real_vocab_size=REAL)
    assert loss.item() == 0.0
    assert all(g.abs().max() == 0 for g in grads(loss, h_s, w_s))
    mean, m = distill_loss(h_s, w_s, h_t, w_t, labels, real_vocab_size=REAL)
    total, _ = distill_loss(h_s, w_s, h_t, w_t, labels, real_vocab_size=REAL, reduction="sum")
    torch.testing.assert_close(total, mean * m["tokens"].item(), **TIGHT)


def test_bfloat16_close_to_fp32_reference():
    h_s, w_s, h_t, w_t, labels = make(seed=10, dtype=torch.float32)
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (h_s, w_s))
    got, _ = distill_loss(h16, w16, h_t.bfloat16(), w_t.bfloat16(), labels, kind="jsd",
                          real_vocab_size=REAL, chunk_tokens=16)
    want = reference(h16.float(), w16.float(), h_t.bfloat16().float(), w_t.bfloat16().float(),
                     labels, kind="jsd")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    g_h, g_w = grads(got, h16, w16)
    assert g_h.dtype == g_w.dtype == torch.bfloat16


def test_autograd_saves_no_logits():
    """Between forward and backward only inputs are kept, never [N, V] blocks."""
    h_s, w_s, h_t, w_t, labels = make(seed=11, dtype=torch.float32)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    limit = max(h_s.numel(), w_s.numel(), h_t.numel(), w_t.numel())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        distill_loss(h_s, w_s, h_t, w_t, labels, kind="jsd", real_vocab_size=REAL,
                     chunk_tokens=8)
    assert max(saved) <= limit
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        naive_distill_loss(h_s, w_s, h_t, w_t, labels, kind="jsd", real_vocab_size=REAL)
    assert max(saved) >= 33 * REAL > limit  # the check can tell the difference


@pytest.mark.parametrize("kwargs,match", [
    (dict(teacher="both"), "either teacher_hidden_NH"),
    (dict(teacher="none"), "either teacher_hidden_NH"),
    (dict(kind="jsd", beta=1.0), r"beta must be in \(0, 1\)"),
    (dict(ce_weight=1.5), r"ce_weight must be in \[0, 1\]"),
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(kind="kl"), "kind must be one of"),
    (dict(teacher="inf"), "must be finite"),
    (dict(teacher="padded_id"), "padded vocabulary id"),
])
def test_bad_inputs_are_rejected(kwargs, match):
    h_s, w_s, h_t, w_t, labels = make()
    logps, ids = torch.log_softmax(h_t @ w_t[:REAL].T, -1).topk(4, dim=-1)
    teacher = kwargs.pop("teacher", "online")
    if teacher == "inf":
        logps[1, 3] = -math.inf
    if teacher == "padded_id":
        ids[1, 3] = REAL + 2
    args = {"online": (h_t, w_t, None), "both": (h_t, w_t, (ids, logps)),
            "none": (None, None, None)}.get(teacher, (None, None, (ids, logps)))
    with pytest.raises(ValueError, match=match):
        distill_loss(h_s, w_s, args[0], args[1], labels, teacher_topk=args[2],
                     real_vocab_size=REAL, **kwargs)


def test_naive_reference_forward_kl_is_f_kl_div():
    h_s, w_s, h_t, w_t, labels = make(seed=12, ignore_every=0)
    s = F.log_softmax(h_s @ w_s.T, -1)
    t = F.log_softmax(h_t @ w_t[:PADDED].T, -1)
    want = F.kl_div(s, t, log_target=True, reduction="batchmean")
    got = naive_distill_loss(h_s, w_s, h_t, w_t[:PADDED], labels)
    torch.testing.assert_close(got, want, **TIGHT)
