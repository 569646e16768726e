"""The sequence RL recipe's config (`SequenceRLConfig`: GRPO's sections over event histories
and item rewards); the recipe is `posttrain.train.sequence_rl`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.sequence_rl` imports them from here (the old import paths
keep working). Importing this module registers the built-in item rewards
(`posttrain.rl.item_rewards`), which the config's ``rewards:`` name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.config.grpo import (AlgorithmConfig, CriticConfig, GRPOEvalConfig, GRPOTrainConfig,
                                   SamplingSettings, SyncCheckConfig, check_advantage)
from posttrain.config.model import ModelConfig
from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
from posttrain.config.rl import EventEpisodesConfig, RolloutEngineConfig
from posttrain.config.train import ExportConfig, RunConfig, check_export
from posttrain.data.event_vocab import (VOCAB_FILE, EventVocab, item_ranges, load_event_vocab,
                                        stop_ids)
from posttrain.errors import ConfigError
from posttrain.rl.dynamic import DynamicSamplingConfig
from posttrain.rl.item_rewards import ITEM_REWARDS
from posttrain.rl.rewards import RewardConfig


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
        """The ids a completion may hold in `vocab` (`posttrain.data.event_vocab.item_ranges`)."""
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
