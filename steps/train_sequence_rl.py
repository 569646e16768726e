"""Train a sequence model with RL: event histories in, generated items out, a business reward.

One step is GRPO's (`steps.train_grpo.GRPOController.step`), with what is text there replaced:

    prompts   -> the next `prompts_per_step` histories of the seeded stream: rows of the
                 bundled or your event data cut to their first events (`events:`)
    rollouts  -> `samples_per_prompt` completions each: `sampling.max_new_tokens` items drawn
                 from the item ids only (`posttrain.rl.items`), on the native engine or your own
    rewards   -> your functions of (completions, histories, columns) over item ids, weighted
    advantages, update, weight sync and its check, metrics, checkpoint: GRPO's

The recipe and its config are `posttrain.train.sequence_rl`'s; the start is an export of the
sequence recipe (`posttrain train-sequence`, which writes ``event_vocab.json`` beside it).

    posttrain train-sequence --config configs/sequence/tiny.yaml          # the start, 20 s
    posttrain train-sequence-rl --config configs/sequence_rl/tiny.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.data.events import EventVocab, load_event_vocab
from posttrain.data.prepared import local_view
from posttrain.rl.items import ItemEpisodes, item_metrics, read_history_rows
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import RewardOutput, combine
from posttrain.train.sequence_rl import SequenceRL, SequenceRLConfig, SequenceRLWorker
from steps.common import main_for, run_recipe
from steps.train_grpo import ColocatedRollouts, GRPOController


class SequenceRLController(GRPOController):
    """GRPO's controller over histories, item completions and item rewards."""

    def __init__(self, cfg: SequenceRLConfig, group: Any, rollouts: Any, vocab: EventVocab,
                 train_rows: list[PromptRow], eval_rows: list[PromptRow], num_ranks: int,
                 packs_documents: bool = True):
        super().__init__(cfg, group, rollouts, vocab, train_rows, eval_rows, num_ranks,
                         packs_documents)
        # the weight-sync probe: a history followed by its own items (ids the loss allows)
        first = train_rows[0].prompt_ids
        tail = [t for t in first if self.episodes.allowed(t)] or [self.episodes.ranges[0][0]]
        self.probe_sequence, self.probe_prompt_len = first + tail, len(first)

    def generation(self, vocab: EventVocab) -> tuple[Any, tuple[int, ...], ItemEpisodes]:
        episodes = ItemEpisodes(vocab, self.cfg.sampling.stop_tokens,
                                semantic_ids=self.cfg.events.generate_semantic_ids)
        return combine(self.cfg.rewards.functions), episodes.stop_ids, episodes

    @classmethod
    def for_run(cls, cfg: SequenceRLConfig, group: Any, context: dict[str, Any]
                ) -> "SequenceRLController":
        """The controller of a driver's run: the vocabulary, the histories and the engines."""
        prepared = context["prepared_dir"]
        vocab = load_event_vocab(f"{local_view(prepared)}/tokenizer")
        train_rows = read_history_rows(prepared, "train", vocab, cfg.events)
        eval_rows = (read_history_rows(prepared, "eval", vocab, cfg.events)[:cfg.eval.max_prompts]
                     if cfg.data.eval else [])
        info = context["info"]
        ctl = cls(cfg, group, ColocatedRollouts(group), vocab, train_rows, eval_rows,
                  info["world_size"], packs_documents=info["packs_documents"])
        ctl.writer = context["writer"]
        return ctl

    def score(self, prompts: list[PromptRow], groups: list[list[Any]]) -> RewardOutput:
        return self.episodes.score(self.reward, prompts, groups)

    def rollout_metrics(self, rollouts: list[Any]) -> dict[str, float]:
        return item_metrics(rollouts, self.episodes.events)

    def eval_scoring(self) -> dict[str, Any]:
        return {"score": self.score}


def run(config: SequenceRLConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate (held-out reward at the start and the end) and export; arguments as
    `steps.common.run_recipe`."""
    return run_recipe(SequenceRL, config, worker=SequenceRLWorker,
                      controller=SequenceRLController.for_run, **kwargs)


RECIPE = SequenceRL
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-sequence-rl", *sys.argv[1:]]))
