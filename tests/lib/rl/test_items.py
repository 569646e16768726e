"""Sequence RL's parts (`posttrain.rl.items`): histories cut from prepared event rows, the ids a
completion may hold, what a reward sees, and the built-in `synthetic_dwell` against its
formula on the synthetic world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
from posttrain.data.events import EventVocab, VocabConfig
from posttrain.data.sources import SourceConfig
from posttrain.data.synthetic import EventDatasetConfig, event_sequences
from posttrain.data.tokenizer import SemanticIdConfig
from posttrain.errors import ConfigError
from posttrain.rl.engine import Rollout
from posttrain.rl.items import (EventEpisodesConfig, ItemEpisodes, item_ranges,
                                read_history_rows, synthetic_dwell)
from posttrain.rl.rewards import RewardSpec, combine

ROOT = Path(__file__).resolve().parents[3]
EVAL_ROWS = ROOT / "assets" / "data" / "events" / "eval.jsonl"
VOCAB = EventVocab(VocabConfig(num_items=100))          # <pad> 0, <bos> 1, <eos> 2, items 3..102


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    from steps import prepare
    out = tmp_path_factory.mktemp("events") / "prepared"
    prepare.run(PrepareConfig(
        tokenizer=None, vocab=VOCAB.cfg, output=OutputConfig(dir=str(out)),
        data=DataConfig(format="sequence", train=[SourceConfig(str(EVAL_ROWS), name="e")])),
        show_progress=False)
    return str(out)


def test_histories_are_the_first_events_and_the_rest_is_the_future(prepared):
    raw = [json.loads(x)["tokens"] for x in EVAL_ROWS.read_text().splitlines()]
    rows = read_history_rows(prepared, "train", VOCAB, EventEpisodesConfig(prompt_events=5))
    assert len(rows) == len(raw) == 100
    for row, tokens in zip(rows, raw):
        assert row.prompt_ids == [1] + [3 + t for t in tokens[:5]]
        assert row.extras["future"] == tokens[5:]
    cut = EventEpisodesConfig(prompt_events=6, cut="random", min_prompt_events=2, seed=3)
    once = read_history_rows(prepared, "train", VOCAB, cut)
    again = read_history_rows(prepared, "train", VOCAB, cut)
    lengths = [len(r.prompt_ids) - 1 for r in once]
    assert [r.prompt_ids for r in once] == [r.prompt_ids for r in again]
    assert set(lengths) == set(range(2, 7))                 # every cut drawn, none outside


def test_allowed_ids_and_what_a_reward_sees():
    sid = EventVocab(VocabConfig(num_items=10, semantic_ids=SemanticIdConfig(
        levels=2, codes_per_level=4)))                      # items 3..12, codes 13..20
    assert item_ranges(sid) == ((3, 13),)
    assert item_ranges(sid, semantic_ids=True, stop_ids=(2,)) == ((2, 21),)
    assert item_ranges(sid, stop_ids=(0,)) == ((0, 1), (3, 13))
    with pytest.raises(ConfigError, match="no semantic-ID codes"):
        item_ranges(VOCAB, semantic_ids=True)
    episodes = ItemEpisodes(sid, ["<eos>"], semantic_ids=True)
    assert episodes.stop_ids == (2,) and episodes.ranges == ((2, 21),)
    assert episodes.events([1, 3, 12, 14, 2]) == [0, 9, "<sid_0_1>"]
    with pytest.raises(ConfigError, match="sampling.stop_tokens: '<stop>'"):
        ItemEpisodes(sid, ["<stop>"])


def test_synthetic_dwell_follows_the_graph_of_the_world():
    world, _ = event_sequences(0, EventDatasetConfig())
    a = 7
    s0 = world.successors[a][2]                  # any successor counts, not only the likeliest
    s1 = world.successors[s0][0]
    jump = next(i for i in range(100) if i not in world.successors[s1] and i != s1)
    got = synthetic_dwell([[s0, s1, jump, "<sid_0_1>"], [], [s0]], [[3, a], [a], ["<bos>"]],
                          {}, off_graph=-1.0)
    want = [(world.dwell[s0] + world.dwell[s1] - 1.0 - 1.0) / 4, 0.0, -1.0]
    assert got == pytest.approx(want, abs=1e-12)


def test_item_rewards_score_completions_against_their_histories(prepared):
    """`ItemEpisodes.score` hands each function (completions, histories, columns) in item
    ids, with the row's future as a column, through GRPO's reward combination."""
    rows = read_history_rows(prepared, "train", VOCAB, EventEpisodesConfig(prompt_events=3))[:2]
    seen = {}

    def spy(completions, histories, columns):
        seen.update(completions=completions, histories=histories, future=columns["future"])
        return [float(len(c)) for c in completions]

    from posttrain.rl import reward_registry
    reward_registry.register("test_items_spy")(spy)
    try:
        reward = combine([RewardSpec("test_items_spy"), RewardSpec("synthetic_dwell")])
        groups = [[Rollout(r.prompt_ids, [5, 6, 2], [0.0] * 3, "stop")] * 2 for r in rows]
        out = ItemEpisodes(VOCAB, ["<eos>"]).score(reward, rows, groups)
    finally:
        del reward_registry._REGISTRY["test_items_spy"]
    assert seen["completions"] == [[2, 3]] * 4                    # <eos> left out
    assert seen["histories"] == [[t - 3 for t in r.prompt_ids[1:]] for r in rows for _ in "ab"]
    assert seen["future"] == [r.extras["future"] for r in rows for _ in "ab"]
    assert out.components["test_items_spy"] == [2.0] * 4
    assert out.total == pytest.approx([2.0 + d for d in out.components["synthetic_dwell"]])
