"""Rollout packing for the GRPO update: packed log-probs equal per-sequence teacher forcing,
the layout is exact, the count pads to the rank count, bad input is refused."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.ops.cross_entropy import IGNORE_INDEX
from posttrain.rl.batch import Sample, pack_micro_batches, split_mini_batches
from posttrain.rl.native import NativeEngine
from posttrain.train.grpo import AlgorithmConfig, GRPOLoss

from .test_native_engine import tiny_model


def random_samples(n: int, seed: int = 0, vocab: int = 100) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(1, 12), rng.randint(1, 10)
        out.append(Sample([rng.randrange(vocab) for _ in range(p)],
                          [rng.randrange(vocab) for _ in range(c)],
                          [-rng.random() for _ in range(c)], rng.uniform(-1, 1)))
    return out


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_packed_logprobs_equal_per_sequence_teacher_forcing(family):
    model = tiny_model(family)
    samples = random_samples(12)
    root = GRPOLoss(model, AlgorithmConfig(), temperature=0.7, constant_norm=None)
    engine = NativeEngine(model)
    batches = pack_micro_batches(samples, max_tokens=48)
    assert len(batches) > 1
    seen = 0
    for b in batches:
        with torch.no_grad():
            logp_ST = root(*(b[k] for k in GRPOLoss.input_keys), score_only=True)
        lens = b["document_lengths"][0]
        assert sum(lens) == b["input_ids"].shape[1] <= 48
        # find each packed sequence among the samples by its tokens
        offset = 0
        for s, n in enumerate(lens):
            tokens = b["input_ids"][0, offset:offset + n].tolist()
            sample = next(x for x in samples if x.prompt_ids + x.completion_ids == tokens)
            ref = engine.logprobs([tokens], [len(sample.prompt_ids)], temperature=0.7)[0]
            c = len(sample.completion_ids)
            assert b["mask"][s].sum() == c
            torch.testing.assert_close(logp_ST[s, :c], torch.tensor(ref), atol=2e-5, rtol=0)
            assert torch.all(logp_ST[s, c:] == 0)
            assert b["advantages"][s] == pytest.approx(sample.advantage)
            assert b["engine_logp"][s, :c].tolist() == pytest.approx(sample.engine_logprobs)
            offset += n
            seen += 1
    assert seen == len(samples)


def test_layout_targets_and_positions():
    samples = [Sample([1, 2, 3], [4, 5], [-0.1, -0.2], 1.0),
               Sample([6], [7, 8, 9], [-1.0] * 3, -1.0)]
    (b,) = pack_micro_batches(samples, max_tokens=64)
    # one micro-batch; sequences keep their input order inside it
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert b["document_lengths"] == [[5, 4]]
    I = IGNORE_INDEX
    assert b["targets"].tolist() == [[I, I, 4, 5, I, 7, 8, 9, I]]
    assert b["token_index"].tolist() == [[2, 3, 0], [5, 6, 7]]
    assert b["mask"].tolist() == [[True, True, False], [True, True, True]]
    assert b["global_tokens"] == 5 and b["global_sequences"] == 2 and b["live"]


def test_micro_batch_count_pads_to_ranks_with_dummies():
    samples = random_samples(10, seed=3)
    real = pack_micro_batches(samples, max_tokens=30)
    padded = pack_micro_batches(samples, max_tokens=30, num_ranks=4)
    assert len(padded) % 4 == 0 and len(padded) >= len(real)
    assert [b["live"] for b in padded] == [True] * len(real) + [False] * (len(padded) - len(real))
    # every sample sits in exactly one live micro-batch; counts are the mini-batch's
    assert sum(b["mask"].shape[0] for b in padded if b["live"]) == 10
    assert {b["global_tokens"] for b in padded} == {sum(len(s.completion_ids) for s in samples)}


def test_split_and_errors():
    samples = random_samples(8)
    assert [len(m) for m in split_mini_batches(samples, 4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="do not split"):
        split_mini_batches(samples, 3)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        pack_micro_batches(samples, max_tokens=4)
    with pytest.raises(ValueError, match="empty completion"):
        pack_micro_batches([Sample([1], [], [], 0.0)], max_tokens=8)
    with pytest.raises(ValueError, match="log-probs for"):
        pack_micro_batches([Sample([1], [2, 3], [0.0], 0.0)], max_tokens=8)


def masked_samples(n: int, seed: int = 0) -> list[Sample]:
    """Multi-turn-like samples: a random loss mask over each completion (its first token
    always trained, as a first turn's is), log-prob 0 where the mask is 0."""
    rng = random.Random(seed + 100)
    out = []
    for s in random_samples(n, seed):
        mask = [1] + [int(rng.random() < 0.6) for _ in s.completion_ids[1:]]
        out.append(Sample(s.prompt_ids, s.completion_ids,
                          [lp if m else 0.0 for lp, m in zip(s.engine_logprobs, mask)],
                          s.advantage, mask))
    return out


def test_a_mask_of_ones_gives_exactly_the_unmasked_batches():
    samples = random_samples(9, seed=7)
    ones = [Sample(s.prompt_ids, s.completion_ids, s.engine_logprobs, s.advantage,
                   [1] * len(s.completion_ids)) for s in samples]
    for a, b in zip(pack_micro_batches(samples, max_tokens=30, num_ranks=2),
                    pack_micro_batches(ones, max_tokens=30, num_ranks=2), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


def test_a_partial_mask_trains_only_the_sampled_tokens():
    """Environment tokens (mask 0) are context: no target, no loss, not counted."""
    samples = [Sample([1, 2], [3, 4, 5, 6], [-0.1, 0.0, 0.0, -0.4], 1.0, [1, 0, 0, 1]),
               Sample([7], [8, 9], [-0.8, -0.9], -1.0)]
    (b,) = pack_micro_batches(samples, max_tokens=64)
    I = IGNORE_INDEX
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert b["targets"].tolist() == [[I, 3, I, I, 6, I, 8, 9, I]]
    assert b["mask"].tolist() == [[True, False, False, True], [True, True, False, False]]
    assert b["token_index"].tolist() == [[1, 2, 3, 4], [6, 7, 0, 0]]
    assert b["global_tokens"] == 4
    with pytest.raises(ValueError, match="a loss mask of 1 for 2 completion tokens"):
        pack_micro_batches([Sample([1], [2, 3], [0.0, 0.0], 0.0, [1])], max_tokens=8)


def test_one_sequence_per_micro_batch_when_documents_cannot_be_separated():
    """`pack=False`, for a transformers model whose attention ignores document boundaries."""
    samples = random_samples(6, seed=5)
    batches = pack_micro_batches(samples, max_tokens=64, num_ranks=4, pack=False)
    live = [b for b in batches if b["live"]]
    assert len(live) == 6 and len(batches) == 8
    assert all(len(b["document_lengths"][0]) == 1 for b in batches)
    assert sorted(b["num_tokens"] for b in live) == sorted(len(s) for s in samples)
    assert {b["global_tokens"] for b in batches} == {sum(len(s.completion_ids) for s in samples)}


def test_rows_filled_to_a_multiple_for_context_parallelism():
    """`row_multiple`: a padding document ends the row; nothing else moves."""
    from posttrain.ops.cross_entropy import IGNORE_INDEX
    from posttrain.rl.batch import Sample, pack_micro_batches
    samples = [Sample([1, 2, 3], [4, 5], [-0.1, -0.2], 1.0),
               Sample([6], [7, 8, 9], [-1.0] * 3, -1.0)]
    plain = pack_micro_batches(samples, max_tokens=32)[0]
    filled = pack_micro_batches(samples, max_tokens=32, row_multiple=4)[0]
    assert plain["input_ids"].shape[1] == 9 and filled["input_ids"].shape[1] == 12
    assert filled["document_lengths"] == [[*plain["document_lengths"][0], 3]]
    assert (filled["targets"][0, 9:] == IGNORE_INDEX).all()
    assert filled["position_ids"][0, 9:].tolist() == [0, 1, 2]
    for key in ("token_index", "mask", "engine_logp", "advantages"):
        assert torch.equal(filled[key], plain[key]), key
    assert filled["num_tokens"] == plain["num_tokens"] == 9
