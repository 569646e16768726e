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
              (`posttrain.rl.items`; built-in: `synthetic_dwell` on the bundled synthetic data)
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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
from posttrain.data.events import VOCAB_FILE, EventVocab, load_event_vocab
from posttrain.errors import ConfigError
from posttrain.rl.dynamic import DynamicSamplingConfig
from posttrain.rl.factory import RolloutEngineConfig
from posttrain.rl.items import ITEM_REWARDS, EventEpisodesConfig, item_ranges, stop_ids
from posttrain.rl.rewards import RewardConfig
from posttrain.train.engine import ModelConfig
from posttrain.train.critic import CriticConfig
from posttrain.train.grpo import (GRPO, AlgorithmConfig, GRPOEvalConfig, GRPOTrainConfig,
                                  GRPOWorker, SamplingSettings, SyncCheckConfig,
                                  check_advantage)
from posttrain.train.recipe import ExportConfig, RunConfig, check_export


@dataclass(frozen=True)
class SequenceRLEvalConfig(GRPOEvalConfig):
    """GRPO's held-out evaluation on the eval rows' histories; `accuracy_reward` names a 0/1
    item reward whose mean is reported as ``eval/accuracy`` (none by default)."""

    accuracy_reward: str | None = None

    def __post_init__(self) -> None:
        if self.tasks:
            raise ValueError("tasks: an event-sequence model has no evaluation suite (its "
                             "held-out metrics come from the run); remove eval.tasks")


@dataclass(frozen=True)
class SequenceRLConfig:
    data: DataConfig
    model: ModelConfig
    train: GRPOTrainConfig
    rewards: RewardConfig
    events: EventEpisodesConfig = EventEpisodesConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampling: SamplingSettings = SamplingSettings(max_new_tokens=8)
    rollout: RolloutEngineConfig = RolloutEngineConfig()
    sync_check: SyncCheckConfig = SyncCheckConfig()
    dynamic_sampling: DynamicSamplingConfig | None = None
    run: RunConfig = RunConfig(dir="runs/sequence_rl")
    eval: SequenceRLEvalConfig = SequenceRLEvalConfig()
    export: ExportConfig = ExportConfig()
    critic: CriticConfig | None = None       # PPO: with algorithm.advantage: gae

    def __post_init__(self) -> None:
        check_advantage(self)
        if self.data.format != "sequence":
            raise ValueError(f"data.format: sequence RL reads event sequences (sequence), not "
                             f"{self.data.format!r}")
        if self.model.hf_dir is None:
            raise ValueError("model.hf_dir: sequence RL starts from a trained sequence model "
                             "(the export of posttrain train-sequence), not model.init")
        for spec in self.rewards.functions:
            if spec.name not in ITEM_REWARDS and ":" not in spec.name:
                raise ConfigError(
                    f"rewards.functions: {spec.name!r} scores text; sequence RL rewards score "
                    "items, fn(completions, histories, columns, **params) -> list[float] "
                    f"(built-in: {', '.join(sorted(ITEM_REWARDS))}; or your own as "
                    "'package.module:function')")
        if self.rollout.kind == "vllm":
            raise ValueError("rollout.kind: vllm does not return log-probs renormalised over "
                             "the item ids; use native or an engine of your own")
        if self.rollout.placement != "colocated":
            raise ValueError("rollout.placement: sequence RL runs its engines colocated with "
                             "the trainer ranks; set rollout.placement: colocated")
        if self.algorithm.reference == "lora_base" and self.model.lora is None:
            raise ValueError("algorithm.reference: lora_base needs model.lora")
        check_export(self.export, self.model.lora)
        if self.eval.temperature == 0 and self.eval.samples_per_prompt != 1:
            raise ValueError("eval.samples_per_prompt > 1 needs eval.temperature > 0 (greedy "
                             "completions of one history are all the same)")
        if self.algorithm.ratio == "sequence" and self.train.engine.parallel.cp > 1:
            raise ValueError("algorithm.ratio: sequence (GSPO) needs train.parallel.cp: 1")
        hf_dir = Path(self.model.hf_dir)
        if (hf_dir / "config.json").is_file():       # else the driver says what makes it
            if not (hf_dir / VOCAB_FILE).is_file():
                raise ConfigError(f"model.hf_dir: {hf_dir} has no {VOCAB_FILE}: sequence RL "
                                  "starts from the export of the sequence recipe (posttrain "
                                  "train-sequence)")
            self.allowed_token_ranges(self.vocab())

    @property
    def episode_tokens(self) -> int:
        """The generation budget of a rollout (the ``constant`` aggregation's default C)."""
        return self.sampling.max_new_tokens

    def allowed_token_ranges(self, vocab: EventVocab) -> tuple[tuple[int, int], ...]:
        """The ids a completion may hold in `vocab` (`posttrain.rl.items.item_ranges`)."""
        return item_ranges(vocab, semantic_ids=self.events.generate_semantic_ids,
                           stop_ids=stop_ids(vocab, self.sampling.stop_tokens))

    def vocab(self) -> EventVocab:
        """The start model's event vocabulary (``event_vocab.json`` beside its weights)."""
        hf_dir = Path(self.model.hf_dir)
        if not (hf_dir / "config.json").is_file():
            how = self.model.produced_by or "configs/sequence/tiny.yaml"
            raise ConfigError(f"model.hf_dir: {hf_dir}/config.json not found; it is the export "
                              f"of the sequence recipe: train it first with `posttrain "
                              f"train-sequence --config {how}`")
        return load_event_vocab(hf_dir)

    def prepare_config(self, output: OutputConfig) -> PrepareConfig:
        """What the prepare step reads: the rows, in the ids of the start model's vocabulary."""
        return PrepareConfig(tokenizer=None, data=self.data, output=output,
                             vocab=self.vocab().cfg)


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
