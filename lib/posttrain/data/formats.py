"""Row formats: validate raw rows into typed records, naming the field that is wrong.

Five formats cover the recipes:

* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` for SFT. An assistant
  message may carry ``"train": false`` to keep it out of the loss, and ``reasoning_content``
  for templates that render thinking blocks.
* ``preference``: ``{"prompt": ..., "chosen": ..., "rejected": ...}`` for DPO and reward
  models; the prompt is shared, each response is a string or a list of assistant messages. A
  pair whose chosen equals its rejected teaches nothing and is refused (``identical_pair``)
  unless `FormatConfig.allow_identical_pairs`.
* ``unpaired``: ``{"prompt": ..., "completion": ..., "label": true | false}`` for KTO: one
  response (a string or a list of assistant messages) labelled desirable (true) or undesirable
  (false). The label must be a JSON boolean: a missing one is ``missing_field``, anything else
  (1, "yes", null) ``wrong_type``.
* ``prompt``: ``{"prompt": ..., <extra columns>}`` for RL; the extra columns (e.g. ``answer``)
  travel with the prompt to the reward functions. A row without one of
  `FormatConfig.required_columns` (the columns the rewards read) is refused, and so is a NaN or
  infinite number anywhere in the extra columns (``non_finite``).
* ``sequence``: ``{"tokens": [int, ...]}`` or ``{"text": "..."}`` for models trained on
  non-language event sequences; every token is a target.

A prompt (and a chat conversation) may also be given as a plain string, meaning one user turn.
Validation never changes content; it only normalizes shapes (string -> one message).

Each format also reads the row layouts datasets are downloaded in (`posttrain.data.shapes`):
ShareGPT and Alpaca rows, TRL's prompt/completion and ``text`` rows for ``chat`` (a ``text`` row
is a document for language modelling: a `SequenceRecord` with ``as_document``), ShareGPT and
Alpaca prompts for ``prompt``, implicit-prompt pairs for ``preference``, and OpenAI content
parts in any message list. `parse_row` detects a row's shape from its keys, or takes the one it
is given; `RowParser` keeps one shape per source, decided by its first row, as `prepare` and the
evaluation suites read sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from posttrain.data.shapes import (DEFAULT_ROLE_MAP, SHAPES, SourceShape, detect,
                                   template_strips_parts, to_canonical)
from posttrain.errors import DataError

FormatName = Literal["chat", "preference", "unpaired", "prompt", "sequence"]
DEFAULT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class FormatConfig:
    """How raw rows are read; column names are configurable for datasets with other schemas."""

    format: FormatName = "chat"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    completion_field: str = "completion"
    label_field: str = "label"
    text_field: str = "text"                 # chat: a document for language modelling
    roles: tuple[str, ...] = DEFAULT_ROLES
    # ShareGPT speaker -> role (`shapes.DEFAULT_ROLE_MAP` and data.role_map)
    role_map: tuple[tuple[str, str], ...] = tuple(DEFAULT_ROLE_MAP.items())
    # content parts: strip each text part before joining, as the tokenizer's template does
    # (Gemma 3, 4); set from the tokenizer by `with_template`
    strip_text_parts: bool = False

    def with_template(self, hf_tokenizer: Any) -> FormatConfig:
        """This config with `strip_text_parts` as the tokenizer's chat template joins content
        parts (`shapes.template_strips_parts`)."""
        return replace(self, strip_text_parts=template_strips_parts(hf_tokenizer))
    required_columns: tuple[str, ...] = ()   # prompt rows: extra columns each row must have
    allow_identical_pairs: bool = False      # preference rows: keep chosen == rejected


@dataclass
class ChatRecord:
    messages: list[dict[str, Any]]


@dataclass
class PreferenceRecord:
    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]


@dataclass
class UnpairedRecord:
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    desirable: bool


@dataclass
class PromptRecord:
    prompt: list[dict[str, Any]]
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class SequenceRecord:
    """Token ids or a text, every token a target. `as_document`: a ``text`` row of format
    chat, tokenized as TRL tokenizes language-modelling rows (the tokenizer's own BOS where it
    adds one, EOS appended; `posttrain.data.encode`)."""

    tokens: list[int] | None = None
    text: str | None = None
    as_document: bool = False


Record = ChatRecord | PreferenceRecord | UnpairedRecord | PromptRecord | SequenceRecord


class _Where:
    """Carries file/line so every error names the row."""

    def __init__(self, file: str | None, line: int | None):
        self.file, self.line = file, line

    def error(self, field_path: str, message: str, reason: str) -> DataError:
        return DataError(message, file=self.file, line=self.line, field=field_path, reason=reason)


class RowParser:
    """The rows of one source: each given the source's shape (`shapes.SourceShape`: forced by
    `shape`, or decided by the first row) and parsed (`parse_row`). `shape` is the shape in
    use, for the manifest."""

    def __init__(self, cfg: FormatConfig, shape: str | None = None):
        self.cfg = cfg
        self._shapes = SourceShape(cfg, shape)

    @property
    def shape(self) -> str | None:
        return self._shapes.shape

    def parse(self, row: Any, *, file: str | None = None, line: int | None = None) -> Record:
        shape = self._shapes.of(row, file, line)
        return parse_row(row, self.cfg, shape=shape, file=file, line=line)


def parse_row(row: dict[str, Any], cfg: FormatConfig, *, shape: str | None = None,
              file: str | None = None, line: int | None = None) -> Record:
    """Validate one raw row for `cfg.format`; raise `DataError` naming file, line and field.

    `shape` is the row's layout (`posttrain.data.shapes`); None detects it from this row's keys
    (the format's own shape when none fits, so the error names the missing field).
    """
    where = _Where(file, line)
    if not isinstance(row, dict):
        raise where.error("<row>", f"expected a JSON object, got {type(row).__name__}",
                          "not_an_object")
    shape = shape or detect(row, cfg) or SHAPES[cfg.format][0]
    row = to_canonical(row, shape, cfg, file=file, line=line)
    if cfg.format == "chat" and shape == "text":
        return _document(row, cfg.text_field, where)
    if cfg.format == "chat" and shape == "prompt_completion":
        return _prompt_completion(row, cfg, where)
    if cfg.format == "chat":
        messages = _messages(_require(row, cfg.messages_field, where), cfg.messages_field,
                             cfg.roles, where)
        _require_assistant(messages, cfg.messages_field, where)
        return ChatRecord(messages)
    if cfg.format == "preference":
        prompt = _messages(_require(row, cfg.prompt_field, where), cfg.prompt_field,
                           cfg.roles, where, string_role="user")
        chosen = _response(_require(row, cfg.chosen_field, where), cfg.chosen_field, cfg, where)
        rejected = _response(_require(row, cfg.rejected_field, where), cfg.rejected_field,
                             cfg, where)
        if chosen == rejected and not cfg.allow_identical_pairs:
            raise where.error(cfg.rejected_field, f"equals {cfg.chosen_field!r}: the pair has "
                              "no preference to learn (data.allow_identical_pairs: true keeps "
                              "such pairs)", "identical_pair")
        return PreferenceRecord(prompt, chosen, rejected)
    if cfg.format == "unpaired":
        prompt = _messages(_require(row, cfg.prompt_field, where), cfg.prompt_field,
                           cfg.roles, where, string_role="user")
        completion = _response(_require(row, cfg.completion_field, where),
                               cfg.completion_field, cfg, where)
        label = _require(row, cfg.label_field, where)
        if not isinstance(label, bool):
            raise where.error(cfg.label_field, f"must be true (desirable) or false "
                              f"(undesirable), got {label!r} ({type(label).__name__})",
                              "wrong_type")
        return UnpairedRecord(prompt, completion, label)
    if cfg.format == "prompt":
        prompt = _messages(_require(row, cfg.prompt_field, where), cfg.prompt_field,
                           cfg.roles, where, string_role="user")
        if prompt[-1]["role"] == "assistant":
            raise where.error(f"{cfg.prompt_field}[{len(prompt) - 1}].role",
                              "a prompt must not end with an assistant turn", "bad_role")
        for name in cfg.required_columns:
            _require_column(row, name, where)
        extras = {k: v for k, v in row.items() if k != cfg.prompt_field}
        _require_finite(extras, where)
        return PromptRecord(prompt, extras)
    if cfg.format == "sequence":
        return _sequence(row, where)
    raise AssertionError(f"unknown format {cfg.format}")


def _prompt_completion(row: dict, cfg: FormatConfig, where: _Where) -> ChatRecord:
    """prompt + completion as one conversation trained on the completion only: the prompt's
    assistant turns (a multi-turn prompt) are marked ``train: false``."""
    prompt = _messages(_require(row, cfg.prompt_field, where), cfg.prompt_field, cfg.roles,
                       where, string_role="user")
    completion = _response(_require(row, cfg.completion_field, where), cfg.completion_field,
                           cfg, where)
    frozen = [{**m, "train": False} if m["role"] == "assistant" else m for m in prompt]
    messages = [*frozen, *completion]
    _require_assistant(messages, cfg.completion_field, where)
    return ChatRecord(messages)


def _document(row: dict, name: str, where: _Where) -> SequenceRecord:
    text = _require(row, name, where)
    if not isinstance(text, str):
        raise where.error(name, f"must be a string, got {type(text).__name__}", "wrong_type")
    if not text.strip():
        raise where.error(name, "empty text", "empty")
    return SequenceRecord(text=text, as_document=True)


def _require(row: dict, key: str, where: _Where) -> Any:
    if key not in row:
        present = ", ".join(sorted(map(str, row))) or "none"
        raise where.error(key, f"missing required field (row has: {present})", "missing_field")
    return row[key]


def _require_column(row: dict, name: str, where: _Where) -> None:
    if row.get(name) is None:
        present = ", ".join(sorted(map(str, row)))
        got = "null" if name in row else "missing"
        raise where.error(name, f"column {name!r} is {got}, but the reward functions read it "
                          f"(data.required_columns); the row has: {present}", "missing_field")


def _require_finite(columns: dict[str, Any], where: _Where) -> None:
    for name, value in columns.items():
        path = _non_finite_path(value, str(name))
        if path is not None:
            raise where.error(path, "NaN or infinite number: give a finite number or null",
                              "non_finite")


def _non_finite_path(value: Any, path: str) -> str | None:
    """The path (``path``, ``path.key``, ``path[i]``) of a NaN or infinite number in `value`,
    a number or lists and objects of them at any depth; None when there is none."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return where
        elif isinstance(node, dict):
            stack.extend((v, f"{where}.{k}") for k, v in node.items()
                         if isinstance(v, (float, dict, list)))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node)
                         if isinstance(v, (float, dict, list)))
    return None


def _messages(value: Any, name: str, roles: tuple[str, ...], where: _Where,
              string_role: str | None = None) -> list[dict[str, Any]]:
    if isinstance(value, str) and string_role is not None:
        if not value.strip():
            raise where.error(name, "empty prompt", "empty")
        return [{"role": string_role, "content": value}]
    if not isinstance(value, list):
        raise where.error(name, f"expected a list of messages, got {type(value).__name__}",
                          "wrong_type")
    if not value:
        raise where.error(name, "empty conversation", "empty")
    return [_message(m, f"{name}[{i}]", roles, where) for i, m in enumerate(value)]


def _message(m: Any, path: str, roles: tuple[str, ...], where: _Where) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise where.error(path, f"a message must be an object, got {type(m).__name__}",
                          "wrong_type")
    role = m.get("role")
    if role is None:
        raise where.error(f"{path}.role", "missing role", "missing_field")
    if role not in roles:
        raise where.error(f"{path}.role", f"unknown role {role!r} (allowed: {', '.join(roles)})",
                          "bad_role")
    content = m.get("content")
    if not isinstance(content, str):
        got = "missing" if "content" not in m else type(content).__name__
        raise where.error(f"{path}.content", f"content must be a string, got {got}",
                          "wrong_type")
    if not content.strip() and role != "assistant" and not m.get("tool_calls"):
        raise where.error(f"{path}.content", "empty content", "empty")
    if "train" in m and not isinstance(m["train"], bool):
        raise where.error(f"{path}.train", "must be true or false", "wrong_type")
    return m


def _require_assistant(messages: list[dict], name: str, where: _Where) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise where.error(name, "conversation has no assistant turn: nothing to train on",
                          "no_assistant_turn")
    if not any(m["role"] == "assistant" and m.get("train", True) for m in messages):
        raise where.error(name, "every assistant turn is marked train: false", "no_assistant_turn")


def _response(value: Any, name: str, cfg: FormatConfig, where: _Where) -> list[dict]:
    messages = _messages(value, name, cfg.roles, where, string_role="assistant")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            raise where.error(f"{name}[{i}].role",
                              f"a response may only hold assistant turns, got {m['role']!r}",
                              "bad_role")
    if not any(m["content"].strip() for m in messages):
        raise where.error(name, "empty response", "empty")
    return messages


def _sequence(row: dict, where: _Where) -> SequenceRecord:
    if "tokens" in row:
        tokens = row["tokens"]
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise where.error("tokens", "must be a list of non-negative integers", "wrong_type")
        if not tokens:
            raise where.error("tokens", "empty sequence", "empty")
        return SequenceRecord(tokens=tokens)
    if "text" in row:
        text = row["text"]
        if not isinstance(text, str):
            raise where.error("text", f"must be a string, got {type(text).__name__}",
                              "wrong_type")
        if not text.strip():
            raise where.error("text", "empty text", "empty")
        return SequenceRecord(text=text)
    raise where.error("tokens", "a sequence row needs 'tokens' or 'text'", "missing_field")
