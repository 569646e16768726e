"""The data parts' config slices: sources, the remote-file cache, the tokenizer, event
vocabularies and their labels, packing, mixing and the loader.

Kept here, apart from the parts (`posttrain.data.sources`, `.tokenizer`, `.packing`, ...),
so that a config is read and checked without importing numpy, pyarrow or torch; each part
imports its slice from here (the old import paths keep working).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.data.shapes import ALL_SHAPES
from posttrain.errors import ConfigError

Format = Literal["auto", "jsonl", "parquet"]
TrainOn = Literal["all_assistant", "last_assistant"]
TargetKind = Literal["classification", "regression"]


@dataclass(frozen=True)
class SourceConfig:
    """One data source: paths, their format, and its weight in a mixture.

    ``format: auto`` picks the reader by extension: ``.jsonl``, ``.json``, ``.ndjson`` (also
    gzipped, ``.jsonl.gz``) are JSON, one object per line or one array of objects (a file whose
    first character is ``[``, see `RowStream`); ``.parquet`` and ``.pq`` are Parquet.

    `shape` forces the layout of the source's rows (``messages``, ``sharegpt``, ``alpaca``,
    ``prompt_completion``, ``text``, ...: `posttrain.data.shapes`); by default it is detected
    from the first row.
    """

    path: str | list[str]
    format: Format = "auto"
    weight: float = 1.0
    name: str | None = None
    shape: str | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("source.path is empty: give a file, directory, glob or s3:// URI")
        if self.shape is not None and self.shape not in ALL_SHAPES:
            raise ValueError(f"shape: {self.shape!r} is not a shape (shapes: "
                             f"{', '.join(ALL_SHAPES)})")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ConfigError(f"source.weight must be a positive number, got {self.weight}")


@dataclass(frozen=True)
class CacheConfig:
    """Local disk cache for remote files.

    `dir` is where each stream makes its own private subdirectory (the system temp dir when
    None); `max_bytes` caps what one stream keeps there at any moment, downloads in progress
    included; `prefetch_files` is how many files ahead of the one being read are fetched.
    """

    dir: str | None = None
    max_bytes: int = 2 << 30
    prefetch_files: int = 2

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ConfigError(f"cache.max_bytes must be positive, got {self.max_bytes}")
        if self.prefetch_files < 1:
            raise ConfigError(f"cache.prefetch_files must be at least 1, got {self.prefetch_files}")


@dataclass(frozen=True)
class SemanticIdConfig:
    """Semantic-ID tokens: `levels` x `codes_per_level` tokens named by `pattern`."""

    levels: int
    codes_per_level: int
    pattern: str = "<sid_{level}_{code}>"

    def __post_init__(self) -> None:
        if self.levels < 1 or self.codes_per_level < 1:
            raise ConfigError(f"semantic_ids: levels ({self.levels}) and codes_per_level "
                              f"({self.codes_per_level}) must both be at least 1")
        if "{level}" not in self.pattern or "{code}" not in self.pattern:
            raise ConfigError(f"semantic_ids.pattern: {self.pattern!r} must contain both "
                              "'{level}' and '{code}'")

    def tokens(self) -> list[str]:
        """All tokens, level-major: <sid_0_0>, <sid_0_1>, ..., <sid_1_0>, ..."""
        return [self.pattern.format(level=level, code=code)
                for level in range(self.levels) for code in range(self.codes_per_level)]


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer's slice of a recipe config.

    `added_tokens` and the semantic-ID tokens are added as atomic, non-special tokens: each
    encodes as one id, may appear in message content (the model is meant to produce them), and
    survives `decode(skip_special_tokens=True)`.
    """

    path: str
    added_tokens: tuple[str, ...] = ()
    semantic_ids: SemanticIdConfig | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    train_on: TrainOn = "all_assistant"

    def __post_init__(self) -> None:
        if self.train_on not in ("all_assistant", "last_assistant"):
            raise ConfigError(f"tokenizer.train_on: {self.train_on!r} is not one of "
                              "['all_assistant', 'last_assistant']")
        if len(set(self.added_tokens)) != len(self.added_tokens):
            raise ConfigError("tokenizer.added_tokens: contains duplicates")


def check_kind(kind: TargetKind, num_classes: int | None, what: str) -> None:
    """A per-position target (`what`: a row label, a head) is a class id in [0, num_classes),
    num_classes >= 2, or one real number (regression, no num_classes)."""
    if kind == "classification" and (num_classes is None or num_classes < 2):
        raise ConfigError(f"{what} of kind classification needs num_classes >= 2, got "
                          f"{num_classes}")
    if kind == "regression" and num_classes is not None:
        raise ConfigError(f"{what} of kind regression has no num_classes (it is one number)")


@dataclass(frozen=True)
class VocabConfig:
    """The event vocabulary (`posttrain.data.events`): specials, items, semantic-ID codes."""

    num_items: int
    special: tuple[str, ...] = ("pad", "bos", "eos")
    semantic_ids: SemanticIdConfig | None = None
    add_bos: bool = True              # start every sequence with <bos>
    add_eos: bool = False             # end every sequence with <eos>

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ConfigError(f"vocab.num_items must be at least 1, got {self.num_items}")
        if len(set(self.special)) != len(self.special) or not all(self.special):
            raise ConfigError(f"vocab.special: names must be unique and non-empty, got "
                              f"{list(self.special)}")
        for flag, name in (("add_bos", "bos"), ("add_eos", "eos")):
            if getattr(self, flag) and name not in self.special:
                raise ConfigError(f"vocab.{flag} needs '{name}' in vocab.special "
                                  f"({list(self.special)})")


@dataclass(frozen=True)
class LabelConfig:
    """One per-position label field of event rows: a class id in [0, num_classes), or a real
    number (regression)."""

    kind: TargetKind
    num_classes: int | None = None

    def __post_init__(self) -> None:
        check_kind(self.kind, self.num_classes, "a label")


@dataclass(frozen=True)
class PackingConfig:
    """How samples are packed; `posttrain.data.packing` describes the algorithm."""

    max_tokens_per_pack: int = 2048
    buffer_samples: int = 512          # best-fit look-ahead buffer (bounded memory)
    overlong: Literal["truncate", "drop"] = "truncate"
    pad_token_id: int = 0
    prefetch_rows: int = 32            # AsyncPacker queue depth, in rows

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_pack", "buffer_samples", "prefetch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PackingConfig.{name}: must be a positive integer, got {value!r}")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"PackingConfig.overlong: must be 'truncate' or 'drop', "
                              f"got {self.overlong!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) \
                or self.pad_token_id < 0:
            raise ConfigError(f"PackingConfig.pad_token_id: must be a non-negative integer, "
                              f"got {self.pad_token_id!r}")


@dataclass(frozen=True)
class MixerConfig:
    """Seed of the source choice and what to do when a source runs out
    (`posttrain.data.mixer`)."""

    seed: int = 0
    on_exhausted: Literal["stop", "drop"] = "drop"

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"MixerConfig.seed: must be a non-negative integer, got {self.seed!r}")
        if self.on_exhausted not in ("stop", "drop"):
            raise ConfigError(f"MixerConfig.on_exhausted: must be 'stop' or 'drop', "
                              f"got {self.on_exhausted!r}")


@dataclass(frozen=True)
class LoaderConfig:
    packing: PackingConfig = PackingConfig()
    mode: Literal["packed", "padded"] = "packed"
    # which shard columns to read: tokens (sequence), pairs (preference), labelled completions
    format: Literal["sequence", "preference", "unpaired"] = "sequence"
    rows_per_batch: int = 1
    shuffle_buffer_samples: int = 0       # 0 keeps the shard order
    seed: int = 0
    epochs: int = 1
    background: bool = True               # pack in a background thread
    mixer: MixerConfig = MixerConfig()
    weights: dict[str, float] = field(default_factory=dict)   # by source name; default 1.0
    # independent data streams (`posttrain.data.loader`); 1: every rank reads the whole stream
    streams: int = 1

    def __post_init__(self) -> None:
        if self.rows_per_batch < 1:
            raise ValueError("rows_per_batch must be positive")
        if self.streams < 1:
            raise ValueError("streams must be at least 1")
        if self.epochs < 1:
            raise ValueError("epochs must be at least 1")
        if self.shuffle_buffer_samples < 0:
            raise ValueError("shuffle_buffer_samples must be >= 0")
