"""One JSON array of rows, read element by element from a binary stream.

Datasets are often published as one ``.json`` file holding an array of row objects. `JsonArray`
decodes such a file a chunk at a time (a chunk grows to hold a long row), so memory holds a
chunk and the row being decoded, never the whole file, and yields each element with the byte
offset just past it, from which a later reader resumes (`posttrain.data.sources.RowStream`
keeps it in its state). Nothing marks where the next element starts after a malformed one, so
malformed JSON stops the read with a `DataError` naming the row (its 1-based index).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import IO, Any

from posttrain.errors import DataError


def read_chunk(f: IO[bytes], size: int, uri: str, line: int) -> bytes:
    """`f.read(size)`; a failure is a `DataError` naming the file and `line`."""
    try:
        return f.read(size)
    except Exception as e:  # a network or decompression failure mid-file
        raise DataError(f"reading failed: {type(e).__name__}: {e}", file=uri, line=line,
                        reason="unreadable_file") from e


def is_json_array(f: IO[bytes], uri: str) -> bool:
    """Whether the JSON file `f` holds one array: its first character after a BOM and blanks
    is ``[``. `f` is left at its start."""
    f.seek(0)
    data = read_chunk(f, 4096, uri, 1)
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    while data and not data.strip():
        data = read_chunk(f, 4096, uri, 1)
    f.seek(0)
    return data.lstrip()[:1] == b"["


class JsonArray:
    """The elements of the JSON array in `f`, each with the byte offset just past it, from
    byte `offset` (0: the start of the file; else just past row `rows_read`, where a saved
    position points). The file is decoded a chunk at a time (a chunk grows to hold a long row),
    so memory holds a chunk and the row being decoded."""

    CHUNK = 1 << 20
    _WHITESPACE = " \t\r\n"

    def __init__(self, f: IO[bytes], uri: str, offset: int, rows_read: int):
        self.f, self.uri = f, uri
        self.offset, self.rows = offset, rows_read   # bytes consumed; rows yielded
        self.buf, self.i, self.eof = "", 0, False      # decoded text; consumed prefix of it
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.json = json.JSONDecoder()

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        if self.offset == 0:
            self._skip_blanks()
            if self.buf.startswith("\ufeff", self.i):
                self._consume(self.i + 1)
            self._skip_blanks()
            if not self._more(1) or self.buf[self.i] != "[":
                raise self._error("expected a JSON array ('[')")
            self._consume(self.i + 1)
        else:
            self.f.seek(self.offset)
        while True:
            self._skip_blanks()
            if not self._more(1):
                raise self._error("the array is not closed (no ']' at the end of the file)")
            if self.buf[self.i] == "]":
                return
            if self.rows:
                if self.buf[self.i] != ",":
                    raise self._error(f"expected ',' or ']' after row {self.rows}, got "
                                      f"{self.buf[self.i]!r}")
                self._consume(self.i + 1)
                self._skip_blanks()
            value, end = self._decode()
            self._consume(end)
            self.rows += 1
            yield value, self.offset

    def _decode(self) -> tuple[Any, int]:
        while True:
            try:
                value, end = self.json.raw_decode(self.buf, self.i)
            except json.JSONDecodeError as e:
                # Input cut short fails near its end, or where an unterminated string began.
                cut = e.pos >= len(self.buf) - 16 or e.msg.startswith("Unterminated string")
                if self.eof or not cut:
                    raise self._error(f"not valid JSON: {e.msg}") from None
                self._read_more()
                continue
            except RecursionError:
                raise self._error("nested too deep for the JSON decoder; flatten the row",
                                  "too_deep") from None
            if end < len(self.buf) or self.eof:   # else a number may go on in the next chunk
                return value, end
            self._read_more()

    def _skip_blanks(self) -> None:
        while self._more(1) and self.buf[self.i] in self._WHITESPACE:
            j = self.i
            while j < len(self.buf) and self.buf[j] in self._WHITESPACE:
                j += 1
            self._consume(j)

    def _more(self, n: int) -> bool:
        """Whether at least `n` characters are left to read, reading more as needed."""
        while len(self.buf) - self.i < n and not self.eof:
            self._read_more()
        return len(self.buf) - self.i >= n

    def _read_more(self) -> None:
        chunk = read_chunk(self.f, max(self.CHUNK, len(self.buf) - self.i), self.uri, self.rows + 1)
        try:
            text = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            raise self._error(f"not valid UTF-8 ({e.reason}); re-encode the file as UTF-8",
                              "invalid_utf8") from None
        self.eof = not chunk
        self.buf, self.i = self.buf[self.i:] + text, 0

    def _consume(self, j: int) -> None:
        self.offset += len(self.buf[self.i:j].encode("utf-8"))
        self.i = j

    def _error(self, message: str, reason: str = "invalid_json") -> DataError:
        return DataError(f"row {self.rows + 1} of the JSON array (byte {self.offset} of the "
                         f"file): {message}; the rows after it cannot be found: fix the file, "
                         "or write it as JSON Lines, one row per line", file=self.uri,
                         line=self.rows + 1, reason=reason)
