"""Sequence RL: GRPO (and its variants) on the sequence recipe's models, over item sequences.

A model pretrained on event sequences (`posttrain.train.sequence`: its export has
``event_vocab.json`` beside the weights) is trained on with a business metric as the reward:

    history   a held row of events cut to its first k (`events:`), ``<bos>`` first; no chat
              template, no text tokenizer: the ids of the model's own event vocabulary
    rollouts  `sampling.max_new_tokens` items sampled after it (`samples_per_prompt` per
              history), only from the item ids (plus semantic-ID codes and stop tokens when
              configured): the engine samples and scores over exactly those ids, and so do the
              trainer's log-probs (`GRPOLoss` over the restricted head), so the importance
              ratio and the weight-sync check compare like with like
    rewards   your functions over item ids, ``fn(completions, histories, columns, **params)``
              (`posttrain.rl.item_rewards`; built-in: `synthetic_dwell` on the bundled
              synthetic data)
    update    GRPO's: the advantage estimators (`algorithm.advantage`), the clipped objective,
              GSPO's sequence ratio, KL to a reference, DAPO's dynamic sampling, mini-batches

Everything but the first and the third line is GRPO's own code: the trainer rank is
`GRPOWorker` with this config class and the allowed ids (`SequenceRLWorker`), the loop is
`steps.train_grpo.GRPOController` with histories, item completions and item rewards
(`steps.train_sequence_rl`), run by the one driver (`steps.common.run_recipe`). Rollout
engines: the native one, or your own (``rollout.kind: package.module:Class``,
`posttrain.rl.engine.RolloutEngine`), colocated with the trainer ranks.

The export is the policy as a Hugging Face causal LM with ``event_vocab.json`` beside it (no
per-position heads: they were trained on the starting model's hidden states).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config.sequence_rl import SequenceRLConfig, SequenceRLEvalConfig
from posttrain.data.events import load_event_vocab
from posttrain.train.grpo import GRPO, GRPOWorker

__all__ = ["SequenceRL", "SequenceRLConfig", "SequenceRLEvalConfig", "SequenceRLWorker"]


class SequenceRLWorker(GRPOWorker):
    """GRPO's trainer rank with sequence RL's config, sampling only the allowed item ids."""

    config_cls = SequenceRLConfig

    def allowed_token_ranges(self) -> tuple[tuple[int, int], ...]:
        return self.cfg.allowed_token_ranges(load_event_vocab(f"{self.prepared_dir}/tokenizer"))

    def export(self, out_dir: str) -> str | None:
        """The policy as an HF causal LM, ``event_vocab.json`` and its special ids with it."""
        from posttrain.train.sequence import write_special_ids
        out = super().export(out_dir)
        if out is not None:
            write_special_ids(Path(out), load_event_vocab(out))
        return out


class SequenceRL(GRPO):
    """The sequence RL recipe for the one driver: GRPO's driver-side parts, no eval suite (the
    held-out reward is measured by the run, at the start and the end)."""

    name = "sequence_rl"
    config_cls = SequenceRLConfig

    @staticmethod
    def eval_suite(cfg: Any, models: dict[str, str]) -> Any:
        return None
