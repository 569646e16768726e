"""posttrain.losses.sequence: label alignment and per-head losses against plain formulas."""

from __future__ import annotations

import math

import torch

from posttrain.losses.sequence import head_loss_sum, labelled, shift_to_next


def test_shift_to_next_stays_inside_documents():
    # two documents (4 and 3 tokens) and a 2-token pad tail, as packing lays them out
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    values = torch.tensor([[10, 11, 12, 13, 20, 21, 22, -100, -100]])
    want = [11, 12, 13, -100, 21, 22, -100, -100, -100]
    assert shift_to_next(values, positions)[0].tolist() == want
    reals = values.float().masked_fill(values == -100, math.nan)
    got = shift_to_next(reals, positions)[0].tolist()
    assert [None if math.isnan(x) else x for x in got] == \
        [None if w == -100 else float(w) for w in want]
    assert labelled(torch.tensor([1, -100, 0])).tolist() == [True, False, True]
    assert labelled(torch.tensor([1.0, math.nan])).tolist() == [True, False]


def test_head_losses_equal_the_plain_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 5, generator=g)
    classes = torch.randint(0, 5, (9,), generator=g)
    loss, correct = head_loss_sum("classification", logits, classes)
    want = sum(-(logits[k, classes[k]] - torch.logsumexp(logits[k], 0)) for k in range(9))
    assert torch.allclose(loss, want, rtol=1e-6)
    assert int(correct) == sum(int(logits[k].argmax() == classes[k]) for k in range(9))
    pred, target = torch.randn(7, generator=g), torch.randn(7, generator=g)
    loss, correct = head_loss_sum("regression", pred, target)
    assert correct is None
    assert torch.allclose(loss, sum((pred[k] - target[k]) ** 2 for k in range(7)), rtol=1e-6)
    empty, _ = head_loss_sum("classification", logits[:0], classes[:0])
    assert float(empty) == 0.0
