"""DPO variants equal their paper formulas; packed-pair log-probs equal each sequence run alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posttrain.data.packing import Packer, PackingConfig, Sample, collate, pad_rows
from posttrain.data.stream import ListStream
from posttrain.losses.dpo import (dpo_loss, dpo_pair_logps, packed_sequence_logps, sequence_ids,
                                  sequence_logps)
from posttrain.ops.cross_entropy import naive_logprobs

TIGHT = dict(rtol=1e-12, atol=1e-12)
B = 9


def logps(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-5 - 20 * torch.rand(B, generator=g, dtype=dtype) for _ in range(4))
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr


def sig(x):
    return 1 / (1 + torch.exp(-x))


def reference(pc, pr, rc, rr, beta, loss_type, eps):
    """The per-pair formulas of the papers, written out."""
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        per = -(1 - eps) * torch.log(sig(beta * h)) - eps * torch.log(sig(-beta * h))
    elif loss_type == "robust":
        per = ((1 - eps) * -torch.log(sig(beta * h)) + eps * torch.log(sig(-beta * h))) \
            / (1 - 2 * eps)
    elif loss_type == "ipo":
        per = (h - 1 / (2 * beta)) ** 2
    else:
        per = torch.clamp(1 - beta * h, min=0)
    return per.mean()


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.0),
                                           ("robust", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_and_grads_match_formula(loss_type, eps, beta):
    pc, pr, rc, rr = logps(seed=1)
    got, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    want = reference(pc, pr, rc, rr, beta, loss_type, eps)
    torch.testing.assert_close(got, want, **TIGHT)
    for a, b in zip(torch.autograd.grad(got, [pc, pr]), torch.autograd.grad(want, [pc, pr])):
        torch.testing.assert_close(a, b, **TIGHT)


def test_fp32_matches_formula():
    pc, pr, rc, rr = logps(seed=2, dtype=torch.float32)
    got, _ = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.05)
    want = reference(pc, pr, rc, rr, 0.3, "sigmoid", 0.05)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_policy_equal_to_reference_gives_log_2():
    pc, pr, _, _ = logps(seed=3, dtype=torch.float32)
    loss, metrics = dpo_loss(pc, pr, pc.detach().clone(), pr.detach().clone(), beta=0.1)
    assert loss.item() == torch.tensor(math.log(2.0), dtype=torch.float32).item()
    assert metrics["margins"].item() == 0 and metrics["accuracy"].item() == 0


def test_metrics_and_reference_gets_no_gradient():
    pc, pr, rc, rr = logps(seed=4)
    rc, rr = rc.clone().requires_grad_(), rr.clone().requires_grad_()
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.2)
    torch.testing.assert_close(m["rewards_chosen"], (0.2 * (pc - rc)).mean().detach(), **TIGHT)
    torch.testing.assert_close(m["rewards_rejected"], (0.2 * (pr - rr)).mean().detach(), **TIGHT)
    margins = 0.2 * ((pc - rc) - (pr - rr)).detach()
    torch.testing.assert_close(m["margins"], margins.mean(), **TIGHT)
    assert m["accuracy"].item() == pytest.approx((margins > 0).double().mean().item())
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    assert rc.grad is None and rr.grad is None and pc.grad is not None


def test_sum_reduction_and_robust_at_zero_noise_is_dpo():
    pc, pr, rc, rr = logps(seed=5)
    total, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, reduction="sum")
    mean, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    robust, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="robust")
    torch.testing.assert_close(total, mean * B, **TIGHT)
    torch.testing.assert_close(robust, mean, **TIGHT)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing applies"),
    (dict(loss_type="robust", label_smoothing=0.5), r"\[0, 0.5\)"),
    (dict(loss_type="nope"), "loss_type must be"),
    (dict(beta=0.0), "beta must be positive"),
])
def test_bad_options_are_rejected(kwargs, match):
    pc, pr, rc, rr = logps()
    with pytest.raises(ValueError, match=match):
        dpo_loss(pc, pr, rc, rr, **{"beta": 0.1, **kwargs})


def test_sequence_logps():
    g = torch.Generator().manual_seed(6)
    token_logp = -torch.rand(3, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) > 0.4
    mask[2] = False
    token_logp[~mask] = float("-inf")  # masked positions never leak, whatever they hold
    want = [sum(token_logp[b, t].item() for t in range(7) if mask[b, t]) for b in range(3)]
    got = sequence_logps(token_logp, mask)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), **TIGHT)
    mean = sequence_logps(token_logp, mask.long(), reduction="mean")
    counts = mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(mean, torch.tensor(want, dtype=torch.float64) / counts, **TIGHT)


# --------------------------------------------------------------------------- packed pairs

VOCAB, REAL, HIDDEN = 48, 41, 12


class TinyModel(torch.nn.Module):
    """Hidden state = token embedding + position embedding: it depends on the document only, so
    packed and alone runs must agree exactly."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.tok = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.pos = torch.nn.Parameter(0.3 * torch.randn(64, HIDDEN, generator=g))
        self.head = torch.nn.Parameter(0.5 * torch.randn(VOCAB, HIDDEN, generator=g))

    def forward(self, ids, positions):
        return self.tok[ids] + self.pos[positions]


def make_pairs(num_pairs, seed):
    """Sample 2p is the chosen, 2p + 1 the rejected response of pair p (shared prompt)."""
    rng = np.random.default_rng(seed)
    samples = []
    for p in range(num_pairs):
        prompt = rng.integers(1, REAL, rng.integers(2, 6))
        for side in range(2):
            response = rng.integers(1, REAL, rng.integers(2, 9))
            ids = np.concatenate([prompt, response]).astype(np.int32)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.uint8)
            samples.append(Sample(input_ids=ids, loss_mask=mask, sample_id=2 * p + side))
    return samples


def alone(model, sample, reduction):
    """One sequence by itself, with full logits."""
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    labels = ids[1:].where(torch.from_numpy(sample.loss_mask[1:]).bool(), -100)
    hidden = model(ids[:-1], torch.arange(len(ids) - 1))
    logp = naive_logprobs(hidden, model.head, labels, real_vocab_size=REAL)
    return logp.sum() if reduction == "sum" else logp.sum() / (labels != -100).sum()


def batch_inputs(rows):
    batch = collate(rows)
    seq_BT = sequence_ids(batch["document_lengths"], batch["row_num_pad"])
    order = [sid for r in rows for sid in r.sample_ids]  # sequence index -> sample id
    where = {sid: s for s, sid in enumerate(order)}
    pairs = torch.tensor([[where[2 * p], where[2 * p + 1]] for p in range(len(order) // 2)])
    return batch, seq_BT, pairs


@pytest.mark.parametrize("mode", ["packed", "padded"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_pair_logps_equal_each_sequence_alone(mode, reduction):
    model, samples = TinyModel(), make_pairs(num_pairs=5, seed=8)
    cfg = PackingConfig(max_tokens_per_pack=32, buffer_samples=4)
    rows = (list(Packer(ListStream(samples), cfg)) if mode == "packed"
            else list(pad_rows(samples, cfg, rows_per_batch=len(samples))))
    batch, seq_BT, pairs = batch_inputs(rows)
    if mode == "packed":
        assert any(r.num_documents > 1 for r in rows) and any(r.num_pad for r in rows)
    hidden = model(batch["input_ids"], batch["position_ids"])
    chosen, rejected = dpo_pair_logps(hidden, model.head, batch["labels"], pairs, seq_BT,
                                      real_vocab_size=REAL, chunk_tokens=7, reduction=reduction)
    want_c = torch.stack([alone(model, samples[2 * p], reduction) for p in range(5)])
    want_r = torch.stack([alone(model, samples[2 * p + 1], reduction) for p in range(5)])
    torch.testing.assert_close(chosen, want_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, want_r, rtol=1e-5, atol=1e-5)
    # every sequence, unpaired (KTO's completions): in sequence order, with its token count
    logp_S, count_S = packed_sequence_logps(hidden, model.head, batch["labels"], seq_BT,
                                            real_vocab_size=REAL, chunk_tokens=7,
                                            reduction=reduction)
    order = [sid for r in rows for sid in r.sample_ids]
    torch.testing.assert_close(logp_S, torch.stack([alone(model, samples[i], reduction)
                                                    for i in order]), rtol=1e-5, atol=1e-5)
    assert count_S.tolist() == [int(samples[i].loss_mask[1:].sum()) for i in order]
    if mode == "padded":  # one sequence per row: the row index is a valid sequence id too
        rows_BT = torch.arange(len(rows))[:, None].expand_as(seq_BT)
        again = dpo_pair_logps(hidden, model.head, batch["labels"], pairs, rows_BT,
                               real_vocab_size=REAL, reduction=reduction)
        torch.testing.assert_close(again[0], chosen, rtol=1e-6, atol=1e-6)
    # Gradients through the DPO loss agree too.
    upstream = lambda c, r: dpo_loss(c, r, c.detach() * 0.9, r.detach() * 1.1, beta=0.3)[0]
    got = torch.autograd.grad(upstream(chosen, rejected), list(model.parameters()))
    want = torch.autograd.grad(upstream(want_c, want_r), list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pair_with_no_response_token_is_rejected():
    model, samples = TinyModel(), make_pairs(num_pairs=2, seed=9)
    samples[3].loss_mask[:] = 0
    rows = list(pad_rows(samples, PackingConfig(max_tokens_per_pack=32), rows_per_batch=4))
    batch, seq_BT, pairs = batch_inputs(rows)
    hidden = model(batch["input_ids"], batch["position_ids"])
    with pytest.raises(ValueError, match=r"paired sequences \[3\] have no response"):
        dpo_pair_logps(hidden, model.head, batch["labels"], pairs, seq_BT, real_vocab_size=REAL)


def test_sequence_ids_from_lengths():
    got = sequence_ids([[2, 3, 1], [4, 2]], [1, 0])
    want = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 3, 3]])
    assert torch.equal(got, want)
