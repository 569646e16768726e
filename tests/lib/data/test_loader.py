"""TrainLoader: resume mid-stream yields exactly the batches of an uninterrupted run."""

import json

import numpy as np
import pytest
import torch

from posttrain.data.encode import schema_for
from posttrain.data.loader import LoaderConfig, TrainLoader, sources_from_manifest
from posttrain.data.mixer import MixerConfig
from posttrain.data.packing import PackingConfig
from posttrain.data.shards import ShardWriter


def _write_source(root, name, n, seed, rows_per_shard=40):
    rng = np.random.default_rng(seed)
    writer = ShardWriter(str(root / name), schema_for("chat"), rows_per_shard=rows_per_shard,
                         rows_per_group=16)
    for _ in range(n):
        length = int(min(120, rng.lognormal(3, 0.8)) + 2)
        ids = rng.integers(5, 1000, size=length).astype(np.int32)
        mask = (rng.random(length) < 0.6).astype(np.int8)
        mask[-1] = 1
        writer.write({"input_ids": ids, "loss_mask": mask, "num_tokens": length,
                      "num_loss_tokens": int(mask.sum())})
    return [s.uri for s in writer.close()]


@pytest.fixture
def sources(tmp_path):
    return {"a": _write_source(tmp_path, "a", 150, 0), "b": _write_source(tmp_path, "b", 90, 1)}


def _cfg(**kw):
    base = dict(packing=PackingConfig(max_tokens_per_pack=128, buffer_samples=16,
                                      prefetch_rows=4),
                rows_per_batch=2, shuffle_buffer_samples=8, seed=3, epochs=2,
                mixer=MixerConfig(seed=5), weights={"a": 2.0, "b": 1.0})
    base.update(kw)
    return LoaderConfig(**base)


def _flat(batch):
    return (batch["input_ids"].numpy().tobytes(), batch["labels"].numpy().tobytes(),
            batch["position_ids"].numpy().tobytes(), json.dumps(batch["document_lengths"]))


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("cut", [1, 7, 23])
def test_resume_yields_identical_batches(sources, background, cut):
    cfg = _cfg(background=background)
    with TrainLoader(sources, cfg) as full:
        expected = [_flat(b) for b in full]
    assert len(expected) > cut + 5
    with TrainLoader(sources, cfg) as first:
        it = iter(first)
        got = [_flat(next(it)) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
    with TrainLoader(sources, cfg) as resumed:
        resumed.load_state_dict(state)
        got += [_flat(b) for b in resumed]
    assert got == expected


def test_ranks_read_disjoint_samples_covering_everything(sources):
    cfg = _cfg(epochs=1, shuffle_buffer_samples=0, weights={})
    def docs(loader):
        out = []
        for b in loader:
            for row, lens in zip(b["input_ids"], b["document_lengths"]):
                pieces = torch.split(row, lens)
                out += [p.tolist() for p, n in zip(pieces, lens)][:len(lens)]
        return out
    with TrainLoader(sources, cfg) as single:
        all_docs = docs(single)
    per_rank = []
    for rank in range(2):
        with TrainLoader(sources, cfg, rank=rank, world_size=2) as loader:
            per_rank.append(docs(loader))
    pad = [0] * 1000
    strip = lambda ds: sorted(tuple(d) for d in ds if d != pad[:len(d)])
    assert strip(per_rank[0] + per_rank[1]) == strip(all_docs)
    assert not set(strip(per_rank[0])) & set(strip(per_rank[1]))


def test_padded_mode_and_counts(sources):
    cfg = _cfg(mode="padded", epochs=1, shuffle_buffer_samples=0)
    with TrainLoader(sources, cfg) as loader:
        batches = list(loader)
    for b in batches:
        assert b["input_ids"].shape[0] <= 2
        assert b["num_real_tokens"] + b["num_pad_tokens"] == b["input_ids"].numel()
        assert all(len(lens) <= 2 for lens in b["document_lengths"])


def test_unknown_weight_name_is_rejected(sources):
    from posttrain.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown source"):
        TrainLoader(sources, _cfg(weights={"c": 1.0}))


def test_sources_from_manifest_errors(tmp_path):
    from posttrain.errors import DataError
    with pytest.raises(DataError, match="run `posttrain prepare` first"):
        sources_from_manifest(str(tmp_path))


# --------------------------------------------------------------------------- preference mode

def _prompt(rng):
    return rng.integers(5, 1000, int(rng.integers(2, 12))).astype(np.int32)


def _respond(rng, prompt):
    """(ids, loss mask) of the prompt and a random response, the mask on the response."""
    resp = rng.integers(5, 1000, int(rng.integers(1, 20))).astype(np.int32)
    return (np.concatenate([prompt, resp]),
            np.r_[np.zeros(len(prompt)), np.ones(len(resp))].astype(np.int8))


def _write_pairs(root, n, seed):
    rng = np.random.default_rng(seed)
    writer = ShardWriter(str(root / "pairs"), schema_for("preference"), rows_per_shard=25,
                         rows_per_group=8)
    pairs = []
    for _ in range(n):
        prompt = _prompt(rng)
        cols = {}
        for side in ("chosen", "rejected"):
            cols[f"{side}_input_ids"], cols[f"{side}_loss_mask"] = _respond(rng, prompt)
        pairs.append(cols)
        sides = ("chosen", "rejected")
        writer.write({**cols, "prompt_length": len(prompt),
                      "num_tokens": sum(len(cols[f"{s}_input_ids"]) for s in sides),
                      "num_loss_tokens": int(sum(cols[f"{s}_loss_mask"].sum() for s in sides))})
    return {"pairs": [s.uri for s in writer.close()]}, pairs


def _pairs_seen(batch):
    """(pair key, chosen tokens, rejected tokens) of each pair, via sequence_ids/pair_index."""
    ids, seq = batch["input_ids"].reshape(-1), batch["sequence_ids"].reshape(-1)
    out = []
    for key, (c, r) in zip(batch["pair_keys"], batch["pair_index"].tolist()):
        out.append((key, tuple(ids[seq == c].tolist()), tuple(ids[seq == r].tolist())))
    return out


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_preference_batches_tie_each_pair_together(tmp_path, mode):
    sources, pairs = _write_pairs(tmp_path, 60, seed=4)
    cfg = LoaderConfig(packing=PackingConfig(max_tokens_per_pack=64, buffer_samples=8),
                       mode=mode, format="preference", rows_per_batch=3, background=False)
    with TrainLoader(sources, cfg) as loader:
        batches = list(loader)
    seen = [p for b in batches for p in _pairs_seen(b)]
    assert sum(b["num_pairs"] for b in batches) == len(seen) == 60
    want = {}
    for i, cols in enumerate(pairs):          # 25 rows per file, 1-based rows
        key = (i // 25 << 32) | (i % 25 + 1)
        want[key] = (tuple(cols["chosen_input_ids"]), tuple(cols["rejected_input_ids"]))
    assert {k: (c, r) for k, c, r in seen} == want
    if mode == "padded":
        assert all(b["input_ids"].shape[0] == 2 * b["num_pairs"] for b in batches)
    else:
        assert any(b["num_pairs"] > b["input_ids"].shape[0] for b in batches)


# --------------------------------------------------------------------------- unpaired mode

def _write_completions(root, n, seed):
    rng = np.random.default_rng(seed)
    writer = ShardWriter(str(root / "unpaired"), schema_for("unpaired"), rows_per_shard=25,
                         rows_per_group=8)
    rows = []
    for _ in range(n):
        ids, mask = _respond(rng, _prompt(rng))
        row = {"input_ids": ids, "loss_mask": mask, "num_tokens": len(ids),
               "num_loss_tokens": int(mask.sum()), "desirable": bool(rng.random() < 0.5)}
        rows.append(row)
        writer.write(row)
    return {"unpaired": [s.uri for s in writer.close()]}, rows


def _completions_seen(batch):
    """(key, tokens, label) of each sequence, via sequence_ids and the per-sequence labels."""
    ids, seq = batch["input_ids"].reshape(-1), batch["sequence_ids"].reshape(-1)
    assert batch["desirable"].shape == (batch["num_completions"],)
    return [(key, tuple(ids[seq == s].tolist()), bool(batch["desirable"][s]))
            for s, key in enumerate(batch["completion_keys"])]


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_unpaired_batches_carry_each_completions_label_and_key(tmp_path, mode):
    sources, rows = _write_completions(tmp_path, 60, seed=6)
    cfg = LoaderConfig(packing=PackingConfig(max_tokens_per_pack=64, buffer_samples=8),
                       mode=mode, format="unpaired", rows_per_batch=3, background=False,
                       shuffle_buffer_samples=10)
    with TrainLoader(sources, cfg) as loader:
        batches = list(loader)
    seen = [c for b in batches for c in _completions_seen(b)]
    want = {(i // 25 << 32) | (i % 25 + 1): (tuple(r["input_ids"]), r["desirable"])
            for i, r in enumerate(rows)}
    assert len(seen) == 60 and {k: (ids, label) for k, ids, label in seen} == want
    assert {label for _, _, label in seen} == {True, False}
    if mode == "packed":
        assert any(b["num_completions"] > b["input_ids"].shape[0] for b in batches)


@pytest.mark.parametrize("fmt", ["preference", "unpaired"])
def test_pair_and_completion_resume_keeps_keys_and_labels(tmp_path, fmt):
    write, seen = ((_write_pairs, _pairs_seen) if fmt == "preference"
                   else (_write_completions, _completions_seen))
    sources, _ = write(tmp_path, 80, seed=5)
    cfg = LoaderConfig(packing=PackingConfig(max_tokens_per_pack=64, buffer_samples=8),
                       format=fmt, rows_per_batch=2, shuffle_buffer_samples=10, epochs=2)
    with TrainLoader(sources, cfg) as full:
        expected = [seen(b) for b in full]
    with TrainLoader(sources, cfg) as first:
        it = iter(first)
        got = [seen(next(it)) for _ in range(7)]
        state = json.loads(json.dumps(first.state_dict()))
    with TrainLoader(sources, cfg) as resumed:
        resumed.load_state_dict(state)
        got += [seen(b) for b in resumed]
    assert got == expected


def test_label_columns_reach_the_batch_and_resume_exactly(tmp_path):
    """Event shards' label_<name> columns ride the shuffle buffer and the packer as side
    columns; a restored loader (shuffle buffer full of labelled samples) continues exactly."""
    import pyarrow as pa
    rng = np.random.default_rng(0)
    schema = schema_for("sequence").append(pa.field("label_kind", pa.list_(pa.int32()))) \
        .append(pa.field("label_val", pa.list_(pa.float32())))
    writer = ShardWriter(str(tmp_path / "ev"), schema, rows_per_shard=30, rows_per_group=8)
    for _ in range(70):
        n = int(rng.integers(3, 40))
        ids = rng.integers(3, 100, n).astype(np.int32)
        val = (ids / 8).astype(np.float32)
        val[rng.random(n) < 0.2] = np.nan
        writer.write({"input_ids": ids, "loss_mask": np.ones(n, np.int8), "num_tokens": n,
                      "num_loss_tokens": n, "label_kind": ids % 5, "label_val": val})
    sources = {"ev": [s.uri for s in writer.close()]}
    cfg = _cfg(weights={}, shuffle_buffer_samples=16, background=False)

    def flat(batch):
        return (*_flat(batch), batch["label_kind"].numpy().tobytes(),
                batch["label_val"].numpy().tobytes())

    with TrainLoader(sources, cfg) as loader:
        full = [flat(b) for b in loader]
    with TrainLoader(sources, cfg) as loader:
        batch = next(iter(loader))
        ids, kind, val = batch["input_ids"], batch["label_kind"], batch["label_val"]
        real = kind != -100
        assert torch.equal(kind[real], ids[real] % 5)      # each label is its token's
        assert torch.equal(val[~torch.isnan(val)], (ids[~torch.isnan(val)] / 8).float())
        state = json.loads(json.dumps(loader.state_dict()))
    with TrainLoader(sources, cfg) as resumed:
        resumed.load_state_dict(state)
        assert [flat(batch)] + [flat(b) for b in resumed] == full


# --------------------------------------------------------------------------- damaged shards

def _prepared(tmp_path, rows=100):
    """A prepared directory of one train source in 3 shards, with its manifest."""
    import dataclasses
    rng = np.random.default_rng(0)
    writer = ShardWriter(str(tmp_path / "shards"), schema_for("chat"), rows_per_shard=40,
                         rows_per_group=16)
    for _ in range(rows):
        ids = rng.integers(5, 1000, size=int(rng.integers(4, 40))).astype(np.int32)
        writer.write({"input_ids": ids, "loss_mask": np.ones(len(ids), np.int8),
                      "num_tokens": len(ids), "num_loss_tokens": len(ids)})
    shards = [dataclasses.asdict(s) for s in writer.close()]
    manifest = {"sources": [{"name": "a", "split": "train", "shards": shards}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return [s["uri"] for s in shards]


@pytest.mark.parametrize("damage, says", [
    ("truncate", "has .* bytes, but prepare wrote .* truncated or replaced"),
    ("delete", "a prepared shard is missing"),
    ("replace", "has .* bytes, but prepare wrote .*40 rows"),
])
def test_a_truncated_missing_or_replaced_shard_is_a_named_error(tmp_path, damage, says):
    from pathlib import Path

    from posttrain.errors import DataError
    uris = _prepared(tmp_path)
    shard = Path(uris[1])
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    elif damage == "delete":
        shard.unlink()
    else:                                 # a valid Parquet file with fewer rows: a short epoch
        import pyarrow.parquet as pq
        pq.write_table(pq.read_table(shard).slice(0, 10), shard)
    with pytest.raises(DataError, match=says) as e:
        sources_from_manifest(str(tmp_path))
    assert e.value.file == str(shard)


def test_a_corrupted_byte_inside_a_shard_fails_its_page_checksum_naming_the_file(tmp_path):
    from pathlib import Path

    from posttrain.data.sources import RowStream
    from posttrain.errors import DataError
    uris = _prepared(tmp_path)
    assert sum(1 for _ in RowStream(uris, fmt="parquet")) == 100
    shard = Path(uris[0])
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x5A                 # inside the column chunks; the size is the same
    shard.write_bytes(bytes(data))
    sources_from_manifest(str(tmp_path))           # the size still matches
    with pytest.raises(DataError) as e:
        list(RowStream(uris, fmt="parquet"))
    assert e.value.file == str(shard) and e.value.reason == "invalid_parquet", e.value
