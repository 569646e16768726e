"""posttrain.data.synthetic: the bundled event dataset is the generator's output, and it has the
structure a model can learn (the next item mostly the current item's top successor)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from posttrain.data.synthetic import (EventDatasetConfig, dataset_files, event_sequences,
                                      write_event_dataset)

ROOT = Path(__file__).resolve().parents[3]
BUNDLED = ROOT / "assets" / "data" / "events"


def test_bundled_files_are_the_generators_output():
    for name, text in dataset_files().items():
        assert (BUNDLED / name).read_text() == text, (
            f"{BUNDLED / name} differs from posttrain.data.synthetic.dataset_files(); "
            f"regenerate it with `python -m posttrain.data.synthetic {BUNDLED}`")
    size = sum((BUNDLED / n).stat().st_size for n in ("train.jsonl", "eval.jsonl"))
    assert size < 300_000


def test_generator_is_deterministic_and_seeded(tmp_path):
    paths = write_event_dataset(tmp_path, train_sequences=5, eval_sequences=2)
    assert len(paths["train.jsonl"].read_text().splitlines()) == 5
    assert len(paths["eval.jsonl"].read_text().splitlines()) == 2
    assert event_sequences(20)[1] == event_sequences(20)[1]
    assert event_sequences(20)[1] != event_sequences(20, EventDatasetConfig(seed=1))[1]


def test_sequences_follow_the_world():
    cfg = EventDatasetConfig()
    world, rows = event_sequences(300, cfg)
    follows = steps = typed = labelled_dwell = events = 0
    for r in rows:
        tokens, labels = r["tokens"], r["labels"]
        assert cfg.min_len <= len(tokens) <= cfg.max_len
        assert len(labels["event_type"]) == len(labels["dwell"]) == len(tokens)
        for a, b in zip(tokens, tokens[1:]):
            steps += 1
            follows += b == world.successors[a][0]
        for item, t, d in zip(tokens, labels["event_type"], labels["dwell"]):
            events += 1
            typed += t == world.event_type[item]
            if d is not None:
                labelled_dwell += 1
                assert abs(d - world.dwell[item]) <= 0.55
    # the top successor: (1 - jump) * 0.6 of the steps; the item's type: 0.8 + 0.2 / 4
    assert follows / steps == pytest.approx((1 - cfg.jump) * cfg.transition[0], abs=0.03)
    assert typed / events == pytest.approx(1 - cfg.type_noise * 3 / 4, abs=0.03)
    assert labelled_dwell / events == pytest.approx(1 - cfg.dwell_missing, abs=0.03)
    top = Counter(t for r in rows for t in r["tokens"]).most_common(1)[0][1]
    assert top / events < 0.05                      # no item dominates: chance is ~1 / 100


def test_rows_are_valid_event_rows():
    from posttrain.data.encode import LengthConfig
    from posttrain.data.events import EventEncoder, EventVocab, LabelConfig, VocabConfig
    encoder = EventEncoder(EventVocab(VocabConfig(num_items=100)),
                           {"event_type": LabelConfig("classification", 4),
                            "dwell": LabelConfig("regression")}, LengthConfig(256))
    for line in (BUNDLED / "eval.jsonl").read_text().splitlines():
        encoder.encode_row(json.loads(line))
