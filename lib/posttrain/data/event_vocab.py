"""The id layout of an event vocabulary (`EventVocab`, made from the config's `VocabConfig`;
the layout is `posttrain.data.events`' docstring, which also says how event rows are encoded),
and ``event_vocab.json``, where a prepared dataset and an export keep it (`load_event_vocab`);
the ids sequence RL may generate in it (`item_ranges`, `stop_ids`).

Pure Python (no numpy, pyarrow or torch): a recipe config checks itself against the layout when
it is read (the ``<pad>`` id, the ids sequence RL may generate).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from posttrain.config.data import SemanticIdConfig, VocabConfig
from posttrain.config.rl import TokenRanges, check_token_ranges
from posttrain.errors import ConfigError, DataError


VOCAB_FILE = "event_vocab.json"


class EventVocab:
    """The id layout of a `VocabConfig` (`posttrain.data.events`)."""

    def __init__(self, cfg: VocabConfig):
        self.cfg = cfg
        self.special_ids = {f"<{name}>": i for i, name in enumerate(cfg.special)}
        self.first_item = len(cfg.special)
        self.first_semantic_id = self.first_item + cfg.num_items
        sid = cfg.semantic_ids
        self.semantic_tokens = sid.tokens() if sid else []
        self.vocab_size = self.first_semantic_id + len(self.semantic_tokens)
        self._named = {**self.special_ids,
                       **{t: self.first_semantic_id + i
                          for i, t in enumerate(self.semantic_tokens)}}
        if len(self._named) != len(self.special_ids) + len(self.semantic_tokens):
            raise ConfigError("vocab: a special token's name equals a semantic-ID token's")

    def special_id(self, name: str) -> int | None:
        """The id of special token `name` (``"pad"``), None when the vocabulary has none."""
        return self.special_ids.get(f"<{name}>")

    @property
    def pad_id(self) -> int | None:
        return self.special_id("pad")

    def item_id(self, item: int) -> int:
        assert 0 <= item < self.cfg.num_items, item
        return self.first_item + item

    def semantic_id(self, level: int, code: int) -> int:
        sid = self.cfg.semantic_ids
        assert sid is not None and 0 <= level < sid.levels and 0 <= code < sid.codes_per_level
        return self.first_semantic_id + level * sid.codes_per_level + code

    def token_name(self, token_id: int) -> str:
        """``<name>`` of a special or semantic-ID token, ``item_<i>`` of an item."""
        if token_id < self.first_item:
            return f"<{self.cfg.special[token_id]}>"
        if token_id < self.first_semantic_id:
            return f"item_{token_id - self.first_item}"
        return self.semantic_tokens[token_id - self.first_semantic_id]

    def token_id(self, token: Any, *, file: str | None = None, line: int | None = None,
                 field: str = "tokens") -> int:
        """The id of one row token: an item id (int) or a special / semantic-ID name."""
        if type(token) is int:
            if 0 <= token < self.cfg.num_items:
                return self.first_item + token
            raise DataError(f"item id {token} is out of range: the vocabulary has "
                            f"{self.cfg.num_items} items (ids 0..{self.cfg.num_items - 1}); "
                            f"fix the row or raise vocab.num_items", file=file, line=line,
                            field=field, reason="out_of_range")
        if isinstance(token, str):
            if token in self._named:
                return self._named[token]
            known = ", ".join(list(self.special_ids) + self.semantic_tokens[:2]
                              + (["..."] if len(self.semantic_tokens) > 2 else []))
            raise DataError(f"unknown token {token!r}: a token is an item id or one of "
                            f"{known}", file=file, line=line, field=field,
                            reason="unknown_token")
        raise DataError(f"a token is an item id (integer) or a token name (string), got "
                        f"{type(token).__name__} {token!r}", file=file, line=line, field=field,
                        reason="wrong_type")

    def describe(self) -> dict[str, Any]:
        sid = self.cfg.semantic_ids
        return {"kind": "event_vocab", "vocab_size": self.vocab_size,
                "special": dict(self.special_ids),
                "items": {"first_id": self.first_item, "count": self.cfg.num_items},
                "semantic_ids": None if sid is None else {
                    "first_id": self.first_semantic_id, "levels": sid.levels,
                    "codes_per_level": sid.codes_per_level, "pattern": sid.pattern},
                "add_bos": self.cfg.add_bos, "add_eos": self.cfg.add_eos}

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write ``event_vocab.json`` (the tokenizer's place in a prepared dataset)."""
        Path(out_dir, VOCAB_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")


def load_event_vocab(directory: str | Path) -> EventVocab:
    """The vocabulary of ``<directory>/event_vocab.json`` (a prepared ``tokenizer/`` directory,
    or an exported checkpoint)."""
    path = Path(directory, VOCAB_FILE)
    if not path.is_file():
        raise DataError(f"no {VOCAB_FILE} in {directory}: not an event-sequence dataset or "
                        "model", file=str(path))
    d = json.loads(path.read_text())
    special = sorted(d["special"], key=d["special"].get)
    sid = d["semantic_ids"]
    return EventVocab(VocabConfig(
        num_items=d["items"]["count"], special=tuple(s[1:-1] for s in special),
        semantic_ids=None if sid is None else SemanticIdConfig(
            levels=sid["levels"], codes_per_level=sid["codes_per_level"],
            pattern=sid["pattern"]),
        add_bos=d["add_bos"], add_eos=d["add_eos"]))


def item_ranges(vocab: EventVocab, *, semantic_ids: bool = False,
                stop_ids: Sequence[int] = ()) -> TokenRanges:
    """The ids a completion may hold: the items, the semantic-ID codes with `semantic_ids`,
    and `stop_ids`, as ascending ``[lo, hi)`` windows (adjacent ones merged)."""
    if semantic_ids and not vocab.semantic_tokens:
        raise ConfigError("events.generate_semantic_ids: the model's event vocabulary has no "
                          "semantic-ID codes")
    end = vocab.vocab_size if semantic_ids else vocab.first_semantic_id
    windows = sorted([(vocab.first_item, end), *((t, t + 1) for t in stop_ids)])
    merged: list[tuple[int, int]] = []
    for lo, hi in windows:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return check_token_ranges(merged, vocab.vocab_size)


def stop_ids(vocab: EventVocab, names: Sequence[str]) -> tuple[int, ...]:
    """The ids of `names` (``<eos>``: special tokens of the vocabulary); a ConfigError naming
    ``sampling.stop_tokens`` for another name."""
    out = []
    for name in names:
        if name not in vocab.special_ids:
            raise ConfigError(f"sampling.stop_tokens: {name!r} is not a special token of the "
                              f"event vocabulary ({', '.join(vocab.special_ids)})")
        out.append(vocab.special_ids[name])
    return tuple(dict.fromkeys(out))
