"""The sequence recipe's loss root over a packed batch against a plain per-document reference,
its metrics, and its config checks.

The reference runs each document alone through the model, takes full logits and writes the
objective of `posttrain.losses.sequence` term by term: w_0 x the next-item cross-entropy sum,
plus per head w_k x its loss summed over the positions with a label (the next event's for
``target: next``, the event's own for ``target: current``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posttrain.config.loader import build
from posttrain.data.packing import Packer, PackingConfig, Sample, collate
from posttrain.data.stream import ListStream
from posttrain.errors import ConfigError
from posttrain.models.heads import HeadConfig, PositionHeads
from posttrain.train.sequence import (HeadsConfig, Sequence, SequenceConfig, SequenceLoss,
                                      head_means, head_targets)

from ..rl.test_native_engine import tiny_model

HEADS = HeadsConfig(next_item_weight=0.7, per_position={
    "kind": HeadConfig("classification", num_classes=3, weight=0.5, target="next"),
    "val": HeadConfig("regression", weight=0.2, target="current")})


def _documents(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate([9, 5, 14, 3, 11, 7]):
        ids = rng.integers(3, 100, n).astype(np.int32)
        kind = rng.integers(0, 3, n).astype(np.int64)
        kind[rng.random(n) < 0.3] = -100
        val = rng.normal(size=n).astype(np.float32)
        val[rng.random(n) < 0.3] = np.nan
        out.append(Sample(ids, np.ones(n, np.uint8), sample_id=i,
                          extras={"label_kind": kind, "label_val": val}))
    return out


def _reference(model, docs: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
    total, sums = torch.zeros(()), {"next_item_loss": 0.0, "kind_loss": 0.0, "kind_labelled": 0,
                                    "kind_correct": 0, "val_loss": 0.0, "val_labelled": 0}
    for d in docs:
        ids = torch.from_numpy(d.input_ids).long()
        hidden = model(ids[None])[0]
        logp = torch.log_softmax(model.head(hidden).float(), dim=-1)
        ce = -sum(logp[t, ids[t + 1]] for t in range(len(ids) - 1))
        total = total + HEADS.next_item_weight * ce
        sums["next_item_loss"] += float(ce.detach())
        kind, val = d.extras["label_kind"], d.extras["label_val"]
        for t in range(len(ids)):
            if t + 1 < len(ids) and kind[t + 1] != -100:          # target: next
                logits = model.heads["kind"](hidden[t])
                y = int(kind[t + 1])
                total = total + 0.5 * -(logits[y] - torch.logsumexp(logits, 0))
                sums["kind_loss"] += float(-(logits[y] - torch.logsumexp(logits, 0)).detach())
                sums["kind_labelled"] += 1
                sums["kind_correct"] += int(logits.argmax()) == y
            if not math.isnan(val[t]):                              # target: current
                err = (model.heads["val"](hidden[t])[0] - float(val[t])) ** 2
                total = total + 0.2 * err
                sums["val_loss"] += float(err.detach())
                sums["val_labelled"] += 1
    return total, sums


def _root_and_batch():
    model = tiny_model("qwen3").train()
    root = SequenceLoss(model, HEADS, chunk_tokens=16)
    torch.manual_seed(1)
    model.heads = PositionHeads(HEADS.per_position, model.args.hidden_size)   # off the meta device
    docs = _documents()
    rows = list(Packer(ListStream(docs), PackingConfig(max_tokens_per_pack=24,
                                                       buffer_samples=4)))
    batch = collate(rows)
    batch.update(head_targets(batch, HEADS.per_position))
    return root, model, docs, batch


def test_loss_root_equals_the_per_document_reference_with_its_gradients():
    root, model, docs, batch = _root_and_batch()
    assert batch["input_ids"].shape[0] > 1 and max(batch["row_num_pad"]) > 0
    loss, stats = root(*(batch[k] for k in root.input_keys))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, sums = _reference(model, docs)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for k, v in sums.items():
        assert float(stats[k]) == pytest.approx(v, rel=1e-5, abs=1e-5), k
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert batch["num_loss_tokens"] == sum(len(d.input_ids) - 1 for d in docs)


def test_eval_adds_next_item_hits():
    root, model, docs, batch = _root_and_batch()
    root.eval()
    with torch.no_grad():
        _, stats = root(*(batch[k] for k in root.input_keys))
        hits = 0
        for d in docs:
            ids = torch.from_numpy(d.input_ids).long()
            guess = model.head(model(ids[None])[0]).argmax(-1)
            hits += int((guess[:-1] == ids[1:]).sum())
    assert int(stats["next_item_correct"]) == hits


def test_metrics_are_means_over_each_heads_labelled_positions():
    sums = {"loss": 30.0, "next_item_loss": 20.0, "next_item_correct": 5.0, "kind_loss": 6.0,
            "kind_labelled": 4.0, "kind_correct": 3.0, "val_loss": 2.0, "val_labelled": 8.0}
    recipe = Sequence.__new__(Sequence)
    recipe.cfg = type("C", (), {"heads": HEADS})()
    out = recipe.eval_metrics(sums, units=10)
    assert out == {"eval_kind_loss": 1.5, "eval_kind_accuracy": 0.75, "eval_val_loss": 0.25,
                   "eval_loss": 3.0, "eval_next_item_loss": 2.0,
                   "eval_next_item_accuracy": 0.5, "eval_kind_labels": 4, "eval_val_labels": 8,
                   "eval_next_item_perplexity": math.exp(2.0)}
    # a step's stats arrive divided by its units: the means are the same
    step = {k: v / 10 for k, v in sums.items()}
    assert head_means(step, HEADS.per_position) == pytest.approx(
        {"kind_loss": 1.5, "kind_accuracy": 0.75, "val_loss": 0.25})


BASE = {"vocab": {"num_items": 100},
        "data": {"format": "sequence", "train": [{"path": "x.jsonl"}]},
        "model": {"init": {"family": "qwen3"}},
        "train": {"max_steps": 1, "tokens_per_step": 256,
                  "loader": {"packing": {"max_tokens_per_pack": 256}}},
        "heads": {"per_position": {"kind": {"kind": "classification", "num_classes": 3}}}}


@pytest.mark.parametrize("change, message", [
    ({"data": {"format": "chat", "train": [{"path": "x.jsonl"}]}}, "reads event sequences"),
    ({"vocab": {"num_items": 100, "special": ["bos", "pad"]}},
     "pad_token_id=0 is not the vocabulary's <pad> id 1"),
    ({"model": {"init": {"family": "qwen3"}, "lora": {"rank": 4}}}, "trains the whole model"),
    ({"heads": {"per_position": {"kind": {"kind": "classification"}}}},
     "needs num_classes >= 2"),
    ({"heads": {"next_item_weight": 1.0, "per_positon": {}}}, "did you mean 'per_position'"),
])
def test_bad_configs_fail_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        build(SequenceConfig, {**BASE, **change}, where="sequence.yaml")
    assert build(SequenceConfig, BASE).heads.labels()["kind"].num_classes == 3
