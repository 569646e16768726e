"""The shape a conversation must have before a chat template renders it: a non-empty list of
message mappings, each with a string ``role`` and ``content``, an optional boolean ``train``,
and no special token's text in its content or reasoning (it would render as a control token).
`posttrain.data.tokenizer.ChatTokenizer` checks every conversation it renders with
`check_messages`; a violation is a `DataError` naming the file, row and field."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from posttrain.errors import DataError

__all__ = ["check_messages"]


def check_messages(messages: Sequence[Any], special_re: re.Pattern[str] | None,
                   source: str | None, line: int | None) -> None:
    """Raise a `DataError` for the first message of `messages` that breaks the shape above;
    `special_re` matches the tokenizer's special tokens (None: it has none)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError("expected a non-empty list of messages", file=source, line=line,
                        field="messages", reason="invalid_messages")
    for i, message in enumerate(messages):
        _check_message(i, message, special_re, source, line)


def _check_message(i: int, message: Any, special_re: re.Pattern[str] | None,
                   source: str | None, line: int | None) -> None:
    def fail(what: str, name: str, reason: str) -> DataError:
        return DataError(what, file=source, line=line, field=f"messages[{i}]{name}", reason=reason)

    if not isinstance(message, dict):
        raise fail(f"expected a mapping, got {type(message).__name__}", "", "invalid_message")
    if not isinstance(message.get("role"), str):
        raise fail("missing or non-string 'role'", ".role", "invalid_role")
    if not isinstance(message.get("content"), str):
        raise fail("missing or non-string 'content'", ".content", "invalid_content")
    if not isinstance(message.get("train", True), bool):
        raise fail("'train' must be true or false", ".train", "invalid_train")
    for key in ("content", "reasoning_content", "thinking"):
        value = message.get(key)
        if isinstance(value, str) and special_re is not None:
            found = special_re.search(value)
            if found:
                raise fail(f"contains the special token {found.group()!r}; it would be read as "
                           "a control token (remove or escape it)", f".{key}",
                           "special_token_in_content")
