"""Streams (`train.loader.streams`): each data-parallel rank reads and packs only its share, and
the run's data does not depend on the number of ranks.

On prepared chat data written as many small shard files, with S = 4 streams:

- the global micro-batch order is the same for D = 1, 2, 4 data-parallel ranks: rank r's
  batches are the global batches r, r + D, ... (what `DataParallel.share` would deal out);
- each rank reads 1/D of the shard files (bytes) and packs 1/D of the samples (<= 1.5/D);
- a state merged from every rank's restores exactly on any D that divides S: the batches after
  a resume on 1, 2 or 4 ranks are the ones an uninterrupted run yields;
- a state of another stream count is refused, naming the setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from posttrain.data.loader import LoaderConfig, StreamLoader, sources_from_manifest
from posttrain.data.packing import PackingConfig
from posttrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
STREAMS = 4
CFG = LoaderConfig(packing=PackingConfig(max_tokens_per_pack=256, buffer_samples=16),
                   shuffle_buffer_samples=32, seed=3, epochs=2, streams=STREAMS,
                   background=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[str]]:
    from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
    from posttrain.data.sources import SourceConfig
    from posttrain.data.tokenizer import TokenizerConfig
    from steps import prepare
    out = tmp_path_factory.mktemp("streams") / "prepared"
    data = ROOT / "assets" / "data" / "chat" / "train.jsonl"
    prepare.run(PrepareConfig(TokenizerConfig(path=str(ROOT / "assets" / "tokenizer")),
                              DataConfig(train=[SourceConfig(path=str(data), name="chat")],
                                         max_tokens_per_sample=128),
                              OutputConfig(dir=str(out), rows_per_shard=50)),
                show_progress=False)
    found = sources_from_manifest(str(out), "train")
    assert len(found["chat"]) >= 4 * STREAMS, found      # enough files to read by file
    return found


def _take(loader: StreamLoader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it)["input_ids"] for _ in range(n)]


def _ranks(sources, d: int) -> list[StreamLoader]:
    return [StreamLoader(sources, CFG, own=list(range(r, STREAMS, d))) for r in range(d)]


@pytest.mark.parametrize("d", [2, 4])
def test_the_global_order_does_not_depend_on_the_ranks(sources, d):
    steps = 6
    with StreamLoader(sources, CFG, own=list(range(STREAMS))) as one:
        everything = _take(one, steps * STREAMS)
    ranks = _ranks(sources, d)
    try:
        mine = [_take(loader, steps * STREAMS // d) for loader in ranks]
    finally:
        for loader in ranks:
            loader.close()
    for r in range(d):
        expected = everything[r::d]
        assert len(mine[r]) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(mine[r], expected)), r


@pytest.mark.parametrize("d", [2, 4])
def test_each_rank_reads_and_packs_its_share(sources, d):
    steps = 8
    with StreamLoader(sources, CFG, own=list(range(STREAMS))) as one:
        _take(one, steps * STREAMS)
        bytes_one = sum(os.path.getsize(f) for f in one.files)
        packed_one = one.stats["samples_in"]
    ranks = _ranks(sources, d)
    try:
        for loader in ranks:
            _take(loader, steps * STREAMS // d)
            read = sum(os.path.getsize(f) for f in loader.files)
            assert read <= 1.5 / d * bytes_one, (read, bytes_one)
            assert loader.stats["samples_in"] <= 1.5 / d * packed_one
        # together they read every file once
        assert sorted(f for loader in ranks for f in loader.files) == sorted(one.files)
    finally:
        for loader in ranks:
            loader.close()


@pytest.mark.parametrize("saved_d, resumed_d", [(2, 1), (2, 4), (4, 2), (1, 4)])
def test_a_merged_state_resumes_exactly_on_another_number_of_ranks(sources, saved_d,
                                                                   resumed_d):
    before, after = 5, 4                   # per-stream batches before the save and after it
    with StreamLoader(sources, CFG, own=list(range(STREAMS))) as one:
        uninterrupted = _take(one, (before + after) * STREAMS)
    state: dict = {"streams": {}}
    for loader in _ranks(sources, saved_d):
        _take(loader, before * STREAMS // saved_d)
        state["streams"].update(loader.state_dict()["streams"])
        loader.close()
    for r, loader in enumerate(_ranks(sources, resumed_d)):
        loader.load_state_dict(state)
        got = _take(loader, after * STREAMS // resumed_d)
        loader.close()
        expected = uninterrupted[before * STREAMS:][r::resumed_d]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), (r, saved_d, resumed_d)


def test_a_state_of_another_stream_count_is_refused(sources):
    one = StreamLoader(sources, LoaderConfig(packing=CFG.packing, streams=2, background=False),
                       own=[0, 1])
    _take(one, 2)
    state = one.state_dict()
    one.close()
    with StreamLoader(sources, CFG, own=[0, 1, 2, 3]) as other, \
            pytest.raises(ConfigError, match="streams"):
        other.load_state_dict(state)
    from posttrain.data.loader import TrainLoader
    with TrainLoader(sources, CFG) as single, pytest.raises(ConfigError, match="streams"):
        single.load_state_dict(state)
