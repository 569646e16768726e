"""Errors a user can act on: each says what was wrong, where, and what to do."""

from __future__ import annotations


class PosttrainError(Exception):
    """Base class for user-facing errors (bad config, bad data, missing files)."""


class ConfigError(PosttrainError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


class DataError(PosttrainError, ValueError):
    """A data row or file is malformed.

    `location` names the file and line (or row) and `field` the offending field, so that the
    message alone lets a person find and fix the row.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None, reason: str = "invalid"):
        self.file = file
        self.line = line
        self.field = field
        self.reason = reason
        self.detail = message
        where = []
        if file is not None:
            where.append(str(file) if line is None else f"{file}:{line}")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def to_record(self) -> dict:
        """A JSON-ready record for a rejected-rows report."""
        return {"file": self.file, "line": self.line, "field": self.field,
                "reason": self.reason, "message": self.detail}
