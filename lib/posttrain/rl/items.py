"""RL on event sequences: prompts are event histories, completions are generated items.

The sequence recipe (`posttrain.train.sequence`) pretrains a model on rows of item ids in the
vocabulary of `posttrain.data.events`. Sequence RL (`posttrain.train.sequence_rl`) trains it on
with GRPO's kernels; this module holds what differs from text:

**Histories** (`read_history_rows`). Each prepared ``sequence`` row (``<bos>`` and the ids of
its events) is cut to a history: its first `prompt_events` events (``cut: first``), or a
number drawn per row in [`min_prompt_events`, `prompt_events`] (``cut: random``, from
``random.Random(seed * 1_000_003 + row index)``: the same on every run and resume). A row
shorter than the cut gives all its events. The prompt is ``<bos>`` (when the vocabulary adds
it) and the history's ids; no chat template, no text tokenizer. The events after the history
are the row's column ``future`` (what the user did next), which rewards may read.

**Completions** (`ItemEpisodes.run`). `sampling.max_new_tokens` ids are sampled after the
history, restricted to the allowed ids (`item_ranges`): the items, the semantic-ID codes when
`generate_semantic_ids`, and the stop tokens (`sampling.stop_tokens`, e.g. ``["<eos>"]``, which
end a completion early); no other special token is ever drawn. The restriction travels in
`SamplingConfig.allowed_token_ranges`, so the engine's log-probs and the trainer's are both
renormalised over the same ids (`posttrain.rl.engine`).

**Rewards.** Batched functions over events in the row format of `posttrain.data.events` (an
item id as an integer in [0, num_items), any other token by its name, e.g. ``"<sid_0_3>"``;
``<bos>`` and a final stop token left out)::

    fn(completions: list[list[int | str]], histories: list[list[int | str]],
       columns: dict[str, list], **params) -> list[float]

the shape of GRPO's text rewards (`posttrain.rl.rewards`: completions, what they answer, the
rows' columns), with the same registry, weights, ``package.module:function`` names, config-time
checks of params, and failure handling (a failing function scores 0 on the samples it fails
on, counted, never stops the run). ``columns["future"][i]`` are the events after sample i's
history. Built-in: `synthetic_dwell`, a business metric on the bundled synthetic world
(`posttrain.rl.item_rewards`, where item rewards are registered).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from posttrain.config.rl import EventEpisodesConfig
from posttrain.data.event_vocab import EventVocab, item_ranges, stop_ids
from posttrain.errors import DataError
from posttrain.rl.engine import Rollout, SamplingConfig
from posttrain.rl.item_rewards import ITEM_REWARDS, Event, register_items, synthetic_dwell
from posttrain.rl.prompts import PromptRow, prompt_columns, shard_tables
from posttrain.rl.rewards import CombinedReward, RewardOutput

__all__ = ["EventEpisodesConfig", "ItemEpisodes", "ItemRollout", "ITEM_REWARDS", "item_ranges",
           "read_history_rows", "register_items", "stop_ids", "synthetic_dwell"]


# --------------------------------------------------------------------------- histories


def read_history_rows(prepared_dir: str, split: str, vocab: EventVocab,
                      cfg: EventEpisodesConfig) -> list[PromptRow]:
    """The rows of `split` cut to histories (module docstring), as prompt rows: `prompt_ids`
    ``<bos>`` + the history's ids, ``extras["future"]`` the rest of the row's events."""
    bos, eos = vocab.special_id("bos"), vocab.special_id("eos")
    rows: list[PromptRow] = []
    for name, uri, table in shard_tables(prepared_dir, split):
        if "input_ids" not in table.column_names or "prompt_ids" in table.column_names:
            raise DataError(f"source {name!r}: not event sequences; sequence RL needs data "
                            "prepared with format: sequence", file=uri)
        for ids in table.column("input_ids").to_pylist():
            head = ids[:1] if vocab.cfg.add_bos and ids[:1] == [bos] else []
            events = ids[len(head):]
            if vocab.cfg.add_eos and events[-1:] == [eos]:
                events = events[:-1]
            k = cfg.cut_length(len(rows))
            if not events[:k]:
                raise DataError(f"source {name!r}: a row with no event besides specials",
                                file=uri)
            history = events[:k]
            rows.append(PromptRow(head + history, [{"role": "user", "content":
                                                    render(row_events(vocab, history))}],
                                  {"future": row_events(vocab, events[k:])}))
    if not rows:
        raise DataError(f"the '{split}' split of {prepared_dir} has no rows")
    return rows


def row_events(vocab: EventVocab, ids: Sequence[int]) -> list[Event]:
    """Token ids as the row format writes events: an item as its item id, any other token by
    its name."""
    first, end = vocab.first_item, vocab.first_semantic_id
    return [t - first if first <= t < end else vocab.token_name(t) for t in ids]


def render(events: Sequence[Event]) -> str:
    return " ".join(map(str, events))


# --------------------------------------------------------------------------- completions


@dataclass
class ItemRollout(Rollout):
    """A rollout of items: every sampled id is trained (`loss_mask` None); `answer` is the
    completion in the row format, as text (held-out records)."""

    loss_mask: list[int] | None = None
    answer: str = ""


class ItemEpisodes:
    """Samples item completions of histories and scores them (module docstring); the interface
    of `posttrain.rl.episodes.EpisodeRunner` for the GRPO controller."""

    def __init__(self, vocab: EventVocab, stop_token_names: Sequence[str], *,
                 semantic_ids: bool = False):
        self.vocab = vocab
        self.stop_ids = stop_ids(vocab, stop_token_names)
        self.ranges = item_ranges(vocab, semantic_ids=semantic_ids, stop_ids=self.stop_ids)

    def allowed(self, token_id: int) -> bool:
        return any(lo <= token_id < hi for lo, hi in self.ranges)

    def run(self, rows: Sequence[PromptRow], n: int,
            generate: Callable[[list[list[int]], SamplingConfig, int], list[list[Rollout]]],
            sampling: SamplingConfig) -> list[list[ItemRollout]]:
        """`n` completions of each row's history, result[i][j] sample j of rows[i]; `generate`
        is a rollout engine's, given the allowed ids."""
        sampling = replace(sampling, allowed_token_ranges=self.ranges)
        groups = generate([r.prompt_ids for r in rows], sampling, n)
        return [[ItemRollout(r.prompt_ids, r.completion_ids, r.logprobs, r.finish_reason,
                             answer=render(self.events(r.completion_ids))) for r in group]
                for group in groups]

    def events(self, ids: Sequence[int]) -> list[Event]:
        """What a reward sees of a prompt or a completion: its events in the row format,
        without ``<bos>`` and the stop tokens."""
        skip = {self.vocab.special_id("bos"), *self.stop_ids}
        return row_events(self.vocab, [t for t in ids if t not in skip])

    def score(self, reward: CombinedReward, rows: Sequence[PromptRow],
              groups: Sequence[Sequence[Rollout]]) -> RewardOutput:
        """The reward functions on every completion: (completions, histories, columns), the
        columns of each sample's row (``future``)."""
        k = len(groups[0])
        rollouts = [r for g in groups for r in g]
        histories = [self.events(row.prompt_ids) for row in rows for _ in range(k)]
        columns = {name: [v for v in col for _ in range(k)]
                   for name, col in prompt_columns(list(rows)).items()}
        return reward([self.events(r.completion_ids) for r in rollouts], histories, columns)


def item_metrics(rollouts: Sequence[Rollout], events: Callable[[Sequence[int]], list]
                 ) -> dict[str, float]:
    """Per completion, means: the share of distinct events among its events
    (``items/distinct_fraction``) and of events already in its history
    (``items/seen_fraction``; high when a policy learns to repeat)."""
    distinct = seen = 0.0
    for r in rollouts:
        got, before = events(r.completion_ids), set(events(r.prompt_ids))
        if got:
            distinct += len(set(got)) / len(got)
            seen += sum(e in before for e in got) / len(got)
    n = max(len(rollouts), 1)
    return {"items/distinct_fraction": distinct / n, "items/seen_fraction": seen / n}
