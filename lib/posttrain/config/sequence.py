"""The sequence recipe's config (`SequenceConfig`: the event vocabulary, the per-position
heads); the recipe is `posttrain.train.sequence`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.sequence` imports them from here (the old import paths keep
working).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config.data import LabelConfig, VocabConfig
from posttrain.config.model import HeadConfig, ModelConfig
from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
from posttrain.config.train import (ExportConfig, RunConfig, TrainConfig, check_context_parallel,
                                    check_export, check_step_split)
from posttrain.data.event_vocab import EventVocab


@dataclass(frozen=True)
class HeadsConfig:
    """The model's outputs: the next item's loss weight, and the per-position heads by name
    (each trained on the row label of that name)."""

    next_item_weight: float = 1.0
    per_position: dict[str, HeadConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.next_item_weight < 0:
            raise ValueError("heads.next_item_weight must be >= 0")

    def labels(self) -> dict[str, LabelConfig]:
        """The label fields the rows carry for the heads."""
        return {name: LabelConfig(h.kind, h.num_classes) for name, h in self.per_position.items()}


@dataclass(frozen=True)
class SequenceEvalConfig:
    max_batches: int = 50                     # held-out micro-batches


@dataclass(frozen=True)
class SequenceConfig:
    vocab: VocabConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    heads: HeadsConfig = HeadsConfig()
    run: RunConfig = RunConfig(dir="runs/sequence")
    eval: SequenceEvalConfig = SequenceEvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        if self.data.format != "sequence":
            raise ValueError(f"data.format: the sequence recipe reads event sequences "
                             f"(sequence), not {self.data.format!r}")
        if self.train.loader.format != "sequence":
            raise ValueError("train.loader.format must be sequence")
        if self.model.lora is not None:
            raise ValueError("model.lora: the sequence recipe trains the whole model; remove it")
        check_export(self.export, self.model.lora)
        pad = EventVocab(self.vocab).pad_id
        packing = self.train.loader.packing
        if pad is not None and packing.pad_token_id != pad:
            raise ValueError(f"train.loader.packing.pad_token_id={packing.pad_token_id} is not "
                             f"the vocabulary's <pad> id {pad}; set it to {pad}")
        check_step_split(self.train.micro_batches_per_step, self.run, self.train.engine.parallel,
                         self.train.loader.streams)
        check_context_parallel("sequence", self.train.engine.parallel, self.train.loader)

    def prepare_config(self, output: OutputConfig) -> PrepareConfig:
        """What the prepare step reads: the rows, with ids from `vocab` and the heads' labels."""
        return PrepareConfig(tokenizer=None, data=self.data, output=output, vocab=self.vocab,
                             labels=self.heads.labels())
