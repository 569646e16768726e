"""Recipe configs: the top-level YAML of each step, composed of the parts' own configs.

Each library part owns its small frozen config (`TokenizerConfig`, `SourceConfig`,
`PackingConfig`, ...); a recipe config only composes them and checks cross-part constraints.
`load_recipe(path, cls)` reads YAML with `yaml.safe_load` and fails on the first unknown key,
naming the file and the dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from posttrain.config.loader import build, load_yaml
from posttrain.data.encode import LengthConfig
from posttrain.data.events import LabelConfig, VocabConfig
from posttrain.data.formats import DEFAULT_ROLES, FormatConfig, FormatName
from posttrain.data.shapes import DEFAULT_ROLE_MAP, check_shape
from posttrain.data.sources import CacheConfig, SourceConfig
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class ColumnNames:
    messages: str = "messages"
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    completion: str = "completion"          # format: unpaired; chat prompt/completion rows
    label: str = "label"                    # format: unpaired; true = desirable
    text: str = "text"                      # format: chat; documents for language modelling


@dataclass(frozen=True)
class DataConfig:
    """What to read and how to validate it. `train`/`eval` list sources; names must be unique.

    `required_columns` are extra columns every prompt row must have: the GRPO recipe adds the
    ones its reward functions read (`RewardConfig.required_columns`), so a row that would
    score 0 for want of its answer is a bad row at prepare time instead.

    Each source's rows may come in any shape of the format (`posttrain.data.shapes`; a
    source's `shape` forces one). `role_map` maps ShareGPT speakers to roles, over
    `shapes.DEFAULT_ROLE_MAP` (human -> user, gpt -> assistant, observation -> tool, ...).
    """

    train: list[SourceConfig]
    eval: list[SourceConfig] = field(default_factory=list)
    format: FormatName = "chat"
    columns: ColumnNames = ColumnNames()
    roles: list[str] = field(default_factory=lambda: list(DEFAULT_ROLES))
    role_map: dict[str, str] = field(default_factory=dict)   # ShareGPT speaker -> role
    on_bad_row: Literal["error", "skip"] = "error"
    max_tokens_per_sample: int = 4096
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    required_columns: list[str] = field(default_factory=list)   # format: prompt
    allow_identical_pairs: bool = False         # format: preference; chosen == rejected kept

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("data.train needs at least one source")
        for split in ("train", "eval"):
            names = [s.name for s in getattr(self, split) if s.name]
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"data.{split}: duplicate source name(s) {sorted(dup)}")
        if self.max_tokens_per_sample < 2:
            raise ValueError("max_tokens_per_sample must be at least 2")
        for key, fmt in (("required_columns", "prompt"), ("allow_identical_pairs", "preference")):
            if getattr(self, key) and self.format != fmt:
                raise ValueError(f"data.{key} applies to data.format: {fmt}, not "
                                 f"{self.format!r}")
        for split in ("train", "eval"):
            for i, source in enumerate(getattr(self, split)):
                check_shape(self.format, source.shape, f"data.{split}[{i}].shape")
        for speaker, role in self.role_map.items():
            if role not in self.roles:
                raise ValueError(f"data.role_map: {speaker!r} maps to {role!r}, which is not one "
                                 f"of data.roles {self.roles}")

    def format_config(self) -> FormatConfig:
        c = self.columns
        return FormatConfig(format=self.format, messages_field=c.messages, prompt_field=c.prompt,
                            chosen_field=c.chosen, rejected_field=c.rejected,
                            completion_field=c.completion, label_field=c.label,
                            text_field=c.text, roles=tuple(self.roles),
                            role_map=tuple({**DEFAULT_ROLE_MAP, **self.role_map}.items()),
                            required_columns=tuple(self.required_columns),
                            allow_identical_pairs=self.allow_identical_pairs)

    def length_config(self) -> LengthConfig:
        return LengthConfig(self.max_tokens_per_sample, self.overlong)


@dataclass(frozen=True)
class OutputConfig:
    dir: str                        # local directory or s3:// prefix
    rows_per_shard: int = 50_000

    def __post_init__(self) -> None:
        if self.rows_per_shard < 1:
            raise ValueError("rows_per_shard must be positive")


@dataclass(frozen=True)
class PrepareConfig:
    """Text and chat rows are tokenized with `tokenizer`; event sequences (`format: sequence`
    rows of item ids, `posttrain.data.events`) take their ids from `vocab` instead
    (``tokenizer: null``), with the per-position `labels` their rows may carry."""

    tokenizer: TokenizerConfig | None
    data: DataConfig
    output: OutputConfig
    cache: CacheConfig | None = None
    vocab: VocabConfig | None = None
    labels: dict[str, LabelConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.tokenizer is None) == (self.vocab is None):
            raise ValueError("set exactly one of tokenizer (text and chat rows) or vocab "
                             "(event sequences of item ids)")
        if self.vocab is not None and self.data.format != "sequence":
            raise ValueError(f"vocab: event sequences need data.format: sequence, not "
                             f"{self.data.format!r}")
        if self.labels and self.vocab is None:
            raise ValueError("labels: per-position labels are read from event rows; set vocab")


def load_recipe(path: str | Path, cls: type[T], overrides: dict | None = None) -> T:
    """Load a recipe YAML into `cls`; errors name the file and the key."""
    data = load_yaml(path)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return build(cls, data, where=str(path))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def _set_dotted(data: dict, dotted: str, value) -> None:
    node = data
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: '{key}' is not a mapping")
    node[last] = value
