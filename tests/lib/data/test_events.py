"""posttrain.data.events: the config vocabulary's id layout, row validation with labels, and the
prepare step over event rows (counts, rejects, shard columns)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from posttrain.config.loader import build
from posttrain.config.recipes import PrepareConfig
from posttrain.data.encode import LengthConfig
from posttrain.data.events import (EventEncoder, EventVocab, LabelConfig, VocabConfig,
                                   load_event_vocab)
from posttrain.data.tokenizer import SemanticIdConfig
from posttrain.errors import ConfigError, DataError

VOCAB = VocabConfig(num_items=10, special=("pad", "bos", "eos", "mask"),
                    semantic_ids=SemanticIdConfig(levels=2, codes_per_level=3))
LABELS = {"kind": LabelConfig("classification", num_classes=3),
          "dwell": LabelConfig("regression")}


def _encoder(vocab: VocabConfig = VOCAB, max_tokens: int = 64, overlong: str = "truncate"):
    return EventEncoder(EventVocab(vocab), LABELS, LengthConfig(max_tokens, overlong))


def test_layout_is_specials_then_items_then_semantic_ids():
    v = EventVocab(VOCAB)
    assert v.special_ids == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<mask>": 3}
    assert (v.first_item, v.first_semantic_id, v.vocab_size) == (4, 14, 20)
    assert [v.item_id(i) for i in (0, 9)] == [4, 13]
    assert [v.semantic_id(0, 0), v.semantic_id(0, 2), v.semantic_id(1, 0),
            v.semantic_id(1, 2)] == [14, 16, 17, 19]
    names = [v.token_name(i) for i in range(v.vocab_size)]
    assert names[:5] == ["<pad>", "<bos>", "<eos>", "<mask>", "item_0"]
    assert names[14:] == ["<sid_0_0>", "<sid_0_1>", "<sid_0_2>",
                          "<sid_1_0>", "<sid_1_1>", "<sid_1_2>"]
    assert len(set(names)) == v.vocab_size             # every id has its own token
    for i, name in enumerate(names):                   # and names map back to their ids
        token = int(name[5:]) if name.startswith("item_") else name
        assert v.token_id(token) == i
    assert (v.pad_id, v.special_id("bos"), v.special_id("sep")) == (0, 1, None)


def test_layout_without_semantic_ids_and_saved_vocab_round_trips(tmp_path):
    plain = EventVocab(VocabConfig(num_items=500))
    assert (plain.first_item, plain.vocab_size, plain.semantic_tokens) == (3, 503, [])
    for cfg in (VOCAB, VocabConfig(num_items=500, add_eos=True)):
        EventVocab(cfg).save_pretrained(tmp_path)
        again = load_event_vocab(tmp_path)
        assert again.cfg == cfg and again.describe() == EventVocab(cfg).describe()


def test_row_encodes_to_ids_mask_and_aligned_labels():
    row = {"tokens": [3, "<sid_1_2>", 0, "<mask>"],
           "labels": {"kind": [2, None, 0, 1], "dwell": [1.5, 0.25, None, 3]},
           "user": "ignored"}
    enc = _encoder().encode_row(row)
    c = enc.columns
    assert c["input_ids"].tolist() == [1, 7, 19, 4, 3]              # <bos> first
    assert c["loss_mask"].tolist() == [0, 1, 1, 1, 1]               # <bos> is never a target
    assert c["label_kind"].dtype == np.int32 and c["label_dwell"].dtype == np.float32
    assert c["label_kind"].tolist() == [-100, 2, -100, 0, 1]
    dwell = c["label_dwell"].tolist()
    assert math.isnan(dwell[0]) and math.isnan(dwell[3]) and dwell[1:3] == [1.5, 0.25]
    assert dwell[4] == 3.0
    assert (c["num_tokens"], c["num_loss_tokens"], enc.truncated) == (5, 4, False)
    assert set(c) == set(_encoder().schema.names)


def test_missing_labels_are_all_missing_and_eos_is_appended():
    enc = _encoder(VocabConfig(num_items=10, add_bos=False, add_eos=True)).encode_row(
        {"tokens": [1, 2]})
    c = enc.columns
    assert c["input_ids"].tolist() == [4, 5, 2]
    assert c["label_kind"].tolist() == [-100] * 3 and np.isnan(c["label_dwell"]).all()


def test_truncation_keeps_tokens_and_labels_aligned():
    row = {"tokens": list(range(10)), "labels": {"kind": [i % 3 for i in range(10)]}}
    enc = _encoder(max_tokens=6).encode_row(row)
    assert enc.truncated
    assert enc.columns["input_ids"].tolist() == [1, 4, 5, 6, 7, 8]
    assert enc.columns["label_kind"].tolist() == [-100, 0, 1, 2, 0, 1]
    with pytest.raises(DataError, match="exceed max_tokens_per_sample") as e:
        _encoder(max_tokens=6, overlong="drop").encode_row(row, file="f.jsonl", line=3)
    assert e.value.reason == "too_long"


BAD_ROWS = [
    ({"tokens": [1, 10]}, "tokens[1]", "out_of_range", "item id 10 is out of range"),
    ({"tokens": [-1]}, "tokens[0]", "out_of_range", "vocabulary has 10 items"),
    ({"tokens": [1, "<sid_2_0>"]}, "tokens[1]", "unknown_token", "unknown token"),
    ({"tokens": [1, True]}, "tokens[1]", "wrong_type", "bool"),
    ({"tokens": [1.0]}, "tokens[0]", "wrong_type", "float"),
    ({"tokens": []}, "tokens", "empty", "empty sequence"),
    ({"tokens": "1 2 3"}, "tokens", "wrong_type", "list of tokens"),
    ({"events": [1]}, "tokens", "missing_field", "row has: events"),
    ({"tokens": [1, 2], "labels": [0, 1]}, "labels", "wrong_type", "mapping"),
    ({"tokens": [1, 2], "labels": {"kind": [0]}}, "labels.kind", "label_length",
     "list of 2 values"),
    ({"tokens": [1, 2], "labels": {"kind": [0, 3]}}, "labels.kind[1]", "out_of_range",
     "class 3 is out of range [0, 3)"),
    ({"tokens": [1, 2], "labels": {"kind": [0, 1.0]}}, "labels.kind[1]", "wrong_type",
     "integer or null"),
    ({"tokens": [1, 2], "labels": {"dwell": [0.5, "x"]}}, "labels.dwell[1]", "wrong_type",
     "finite number"),
    ({"tokens": [1, 2], "labels": {"dwell": [float("inf"), 1]}}, "labels.dwell[0]",
     "non_finite", "finite number"),
    ({"tokens": [1, 2], "labels": {"dwell": [0.5, float("nan")]}}, "labels.dwell[1]",
     "non_finite", "got nan"),
    ({"tokens": [1, 2], "labels": {"dwell": [1e39, 1]}}, "labels.dwell[0]",
     "non_finite", "as a float32"),
]


@pytest.mark.parametrize("row, field, reason, text", BAD_ROWS,
                         ids=[f"{b[1]}-{b[2]}" for b in BAD_ROWS])
def test_bad_rows_name_file_row_and_field(row, field, reason, text):
    with pytest.raises(DataError) as e:
        _encoder().encode_row(row, file="events.jsonl", line=12)
    msg = str(e.value)
    assert msg.startswith(f"events.jsonl:12, field '{field}': "), msg
    assert e.value.reason == reason and text in msg


@pytest.mark.parametrize("data, message", [
    ({"num_items": 0}, "num_items must be at least 1"),
    ({"num_items": 5, "special": ["pad", "pad"]}, "must be unique"),
    ({"num_items": 5, "special": ["pad"], "add_bos": True}, "add_bos needs 'bos'"),
    ({"num_items": 5, "special": ["pad", "bos"], "add_eos": True}, "add_eos needs 'eos'"),
    ({"num_items": 5, "num_item": 3}, "num_item: unknown key (did you mean 'num_items'?)"),
])
def test_bad_vocab_config_names_the_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(VocabConfig, data, where="vocab")


def _prepare_config(tmp_path: Path, path: Path, **data) -> PrepareConfig:
    return build(PrepareConfig, {
        "tokenizer": None, "vocab": {"num_items": 10},
        "labels": {"kind": {"kind": "classification", "num_classes": 3}},
        "data": {"format": "sequence", "train": [{"name": "ev", "path": str(path)}], **data},
        "output": {"dir": str(tmp_path / "out")}}, where="prepare")


def test_prepare_config_takes_a_tokenizer_or_a_vocab():
    data = {"format": "sequence", "train": [{"path": "x.jsonl"}]}
    out = {"dir": "o"}
    with pytest.raises(ConfigError, match="exactly one of tokenizer"):
        build(PrepareConfig, {"tokenizer": None, "data": data, "output": out})
    with pytest.raises(ConfigError, match="exactly one of tokenizer"):
        build(PrepareConfig, {"tokenizer": {"path": "t"}, "vocab": {"num_items": 3},
                              "data": data, "output": out})
    with pytest.raises(ConfigError, match="need data.format: sequence"):
        build(PrepareConfig, {"tokenizer": None, "vocab": {"num_items": 3},
                              "data": {**data, "format": "chat"}, "output": out})


def test_prepare_writes_label_columns_and_counts_skipped_rows(tmp_path):
    from steps import prepare
    rows = [{"tokens": [1, 2, 3], "labels": {"kind": [0, 1, 2]}},
            {"tokens": [1, 99]},                                   # out of range: skipped
            {"tokens": [4], "labels": {"kind": [None]}}]
    path = tmp_path / "ev.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = prepare.run(_prepare_config(tmp_path, path, on_bad_row="skip"),
                           show_progress=False)
    src = manifest["sources"][0]
    assert (src["rows_read"], src["rows_written"], src["rows_rejected"]) == (3, 2, 1)
    assert src["rejected_by_reason"] == {"out_of_range": 1}
    reject = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert (reject["line"], reject["field"]) == (2, "tokens[1]")
    assert manifest["tokenizer"]["vocab_size"] == 13
    assert load_event_vocab(tmp_path / "out" / "tokenizer").vocab_size == 13
    table = pq.read_table(src["shards"][0]["uri"]).to_pylist()
    assert [r["input_ids"] for r in table] == [[1, 4, 5, 6], [1, 7]]
    assert [r["label_kind"] for r in table] == [[-100, 0, 1, 2], [-100, -100]]

    with pytest.raises(DataError) as e:
        prepare.run(_prepare_config(tmp_path, path), show_progress=False)
    assert "ev.jsonl:2, field 'tokens[1]'" in str(e.value)
    assert "on_bad_row: skip" in str(e.value)
