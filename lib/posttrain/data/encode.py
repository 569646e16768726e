"""Turn validated records into token columns, applying the over-long policy.

One encoder per format; each returns a dict of columns matching `schema_for(format)`, which is
what the tokenized Parquet shards hold. Over-long samples are truncated (keeping the beginning;
for preference pairs the responses are cut, never the shared prompt), dropped, or refused, per
`LengthConfig`; a sample left with no loss token is refused, because it would teach nothing and
skew the token-weighted loss.

A ``text`` row of format chat (`SequenceRecord.as_document`) is a document for language
modelling, tokenized as TRL's SFTTrainer tokenizes its language-modelling rows: the text with
the tokenizer's own special tokens (a BOS where its post-processor adds one: Llama 3, Gemma;
none for Qwen), then the EOS token appended unless the text already ends with it; every token
is trained and no chat template is applied.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import pyarrow as pa

from posttrain.data.formats import (ChatRecord, FormatName, PreferenceRecord, PromptRecord,
                                    Record, SequenceRecord, UnpairedRecord)
from posttrain.data.tokenizer import ChatTokenizer, Encoded, RenderedChats
from posttrain.errors import DataError


@dataclass(frozen=True)
class LengthConfig:
    max_tokens_per_sample: int = 4096
    overlong: Literal["truncate", "drop", "error"] = "truncate"

    def __post_init__(self) -> None:
        if self.max_tokens_per_sample < 2:
            raise ValueError("max_tokens_per_sample must be at least 2")


T = TypeVar("T")
_IDS = pa.list_(pa.int32())
_MASK = pa.list_(pa.int8())

SCHEMAS: dict[str, pa.Schema] = {
    "chat": pa.schema([("input_ids", _IDS), ("loss_mask", _MASK), ("num_tokens", pa.int32()),
                       ("num_loss_tokens", pa.int32())]),
    "sequence": pa.schema([("input_ids", _IDS), ("loss_mask", _MASK),
                           ("num_tokens", pa.int32()), ("num_loss_tokens", pa.int32())]),
    "preference": pa.schema([("chosen_input_ids", _IDS), ("chosen_loss_mask", _MASK),
                             ("rejected_input_ids", _IDS), ("rejected_loss_mask", _MASK),
                             ("prompt_length", pa.int32()), ("num_tokens", pa.int32()),
                             ("num_loss_tokens", pa.int32())]),
    # one completion, its loss mask on the response, and its label (true: desirable)
    "unpaired": pa.schema([("input_ids", _IDS), ("loss_mask", _MASK), ("num_tokens", pa.int32()),
                           ("num_loss_tokens", pa.int32()), ("desirable", pa.bool_())]),
    "prompt": pa.schema([("prompt_ids", _IDS), ("num_tokens", pa.int32()),
                         ("num_loss_tokens", pa.int32()), ("prompt_messages", pa.string()),
                         ("extras", pa.string())]),
}


def schema_for(fmt: FormatName) -> pa.Schema:
    return SCHEMAS[fmt]


def too_long(n: int, lengths: LengthConfig, file: str | None, line: int | None,
             field: str) -> DataError:
    return DataError(f"{n} tokens exceed max_tokens_per_sample={lengths.max_tokens_per_sample}",
                     file=file, line=line, field=field, reason="too_long")


def fitted_length(n: int, lengths: LengthConfig, file: str | None, line: int | None,
                  field: str) -> int:
    """How many of a sample's n tokens the over-long policy keeps (its first ones); a
    `DataError` when the policy refuses the sample."""
    if n <= lengths.max_tokens_per_sample:
        return n
    if lengths.overlong != "truncate":
        raise too_long(n, lengths, file, line, field)
    return lengths.max_tokens_per_sample


@dataclass
class EncodedRow:
    columns: dict[str, Any]
    truncated: bool


class RecordEncoder:
    """Encode records of one format with one tokenizer and one length policy."""

    def __init__(self, tokenizer: ChatTokenizer, fmt: FormatName, lengths: LengthConfig):
        self.tok = tokenizer
        self.fmt = fmt
        self.lengths = lengths

    @property
    def schema(self) -> pa.Schema:
        """The columns of the encoded rows (`schema_for` the format)."""
        return schema_for(self.fmt)

    def encode(self, record: Record, *, file: str | None = None,
               line: int | None = None) -> EncodedRow:
        if isinstance(record, ChatRecord):
            enc = self.tok.encode_chat(record.messages, source=file, line=line)
            return self._single(enc, file, line, field="messages")
        if isinstance(record, SequenceRecord) and record.as_document:
            ids = self._document_ids(record.text)
            return self._single(Encoded(ids, [1] * len(ids)), file, line, field="text")
        if isinstance(record, SequenceRecord):
            ids = record.tokens if record.tokens is not None else self.tok.encode_text(record.text)
            enc = Encoded(list(ids), [1] * len(ids))
            return self._single(enc, file, line, field="tokens" if record.tokens else "text")
        if isinstance(record, PreferenceRecord):
            return self._preference(record, file, line)
        if isinstance(record, UnpairedRecord):
            enc = self.tok.encode_completion(record.prompt, record.completion, source=file,
                                             line=line)
            row = self._single(enc, file, line, field="completion")
            row.columns["desirable"] = record.desirable
            return row
        if isinstance(record, PromptRecord):
            return self._prompt(record, file, line)
        raise AssertionError(f"unknown record {type(record).__name__}")

    def encode_many(self, records: Sequence[tuple[Record, str | None, int | None]]
                    ) -> list[EncodedRow | DataError]:
        """`encode` of many (record, file, line) at once, each result or DataError in its
        place; chat records are tokenized in one batch (`ChatTokenizer.encode_chats`)."""
        rendered = self._render(records)
        return self._finish(records, rendered, self._tokenize(records, rendered))

    def encode_batches(self, batches: Iterable[tuple[T, Sequence[tuple[Record, str | None,
                                                                   int | None]]]]
                       ) -> Iterator[tuple[T, list[EncodedRow | DataError]]]:
        """`encode_many` of each (tag, batch) in turn, yielded as (tag, results), pipelined:
        while a thread tokenizes one batch's chat texts (the Rust tokenizer releases the GIL
        and spreads them over the cores), this thread renders the next batch's and the caller
        consumes the batch before (writes its shards). The same results, in the same order, as
        `encode_many` batch by batch."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as pool:
            pending = None
            for tag, records in batches:
                rendered = self._render(records)
                started = (tag, records, rendered,
                           pool.submit(self._tokenize, records, rendered))
                if pending is not None:
                    yield self._finished(*pending)
                pending = started
            if pending is not None:
                yield self._finished(*pending)

    def _finished(self, tag: T, records: Sequence, rendered: RenderedChats,
                  work: Future) -> tuple[T, list[EncodedRow | DataError]]:
        return tag, self._finish(records, rendered, work.result())

    def _render(self, records: Sequence[tuple[Record, str | None, int | None]]
                ) -> RenderedChats:
        return self.tok.render_chats([(r.messages, f, ln) for r, f, ln in records
                                      if isinstance(r, ChatRecord)])

    def _tokenize(self, records: Sequence[tuple[Record, str | None, int | None]],
                  rendered: RenderedChats) -> tuple[list[Any], dict[int, EncodedRow | DataError]]:
        """All of a batch's tokenizer work, on one thread: the rendered chat texts in one batch
        call, and each other record whole (no two threads tokenize at once, so no call can
        find the tokenizer borrowed by one that changes its settings; prepare's concurrent save
        of the vocabulary only reads it)."""
        others: dict[int, EncodedRow | DataError] = {}
        for i, (record, file, line) in enumerate(records):
            if not isinstance(record, ChatRecord):
                try:
                    others[i] = self.encode(record, file=file, line=line)
                except DataError as err:
                    others[i] = err
        return self.tok.tokenize_texts(rendered.texts), others

    def _finish(self, records: Sequence[tuple[Record, str | None, int | None]],
                rendered: RenderedChats,
                work: tuple[list[Any], dict[int, EncodedRow | DataError]]
                ) -> list[EncodedRow | DataError]:
        """The batch's rows from its tokenizer work (`_tokenize`): chat rows masked and fitted,
        the others as encoded, each error in its row's place."""
        encodings, others = work
        encoded = iter(self.tok.mask_chats(rendered, encodings))
        out: list[EncodedRow | DataError] = []
        for i, (record, file, line) in enumerate(records):
            if i in others:
                out.append(others[i])
                continue
            enc = next(encoded)
            try:
                if isinstance(enc, DataError):
                    raise enc
                out.append(self._single(enc, file, line, field="messages"))
            except DataError as err:
                out.append(err)
        return out

    def _document_ids(self, text: str) -> list[int]:
        """A language-modelling document's ids (module docstring)."""
        ids = list(self.tok.hf(text, add_special_tokens=True, verbose=False)["input_ids"])
        eos = self.tok.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def _fit(self, enc: Encoded, file, line, field) -> tuple[Encoded, bool]:
        keep = fitted_length(len(enc.input_ids), self.lengths, file, line, field)
        if keep == len(enc.input_ids):
            return enc, False
        return Encoded(enc.input_ids[:keep], enc.loss_mask[:keep]), True

    def _single(self, enc: Encoded, file, line, field) -> EncodedRow:
        enc, truncated = self._fit(enc, file, line, field)
        mask = np.asarray(enc.loss_mask, np.int8)
        n_loss = int(np.count_nonzero(mask))
        if n_loss == 0:
            raise DataError("no token left to train on (after truncation)" if truncated else
                            "no token to train on", file=file, line=line, field=field,
                            reason="no_loss_tokens")
        return EncodedRow({"input_ids": np.asarray(enc.input_ids, np.int32),
                           "loss_mask": mask, "num_tokens": len(mask),
                           "num_loss_tokens": n_loss}, truncated)

    def _preference(self, rec: PreferenceRecord, file, line) -> EncodedRow:
        chosen, rejected = self.tok.encode_preference(rec.prompt, rec.chosen, rec.rejected)
        prompt_len = _shared_prefix(chosen.input_ids, rejected.input_ids)
        limit = self.lengths.max_tokens_per_sample
        if prompt_len >= limit:
            raise too_long(prompt_len, self.lengths, file, line, "prompt")
        truncated = False
        out = {}
        for name, enc in (("chosen", chosen), ("rejected", rejected)):
            fitted, cut = self._fit(enc, file, line, name)
            truncated |= cut
            if not any(fitted.loss_mask):
                raise DataError("response has no token to train on", file=file, line=line,
                                field=name, reason="no_loss_tokens")
            out[f"{name}_input_ids"] = np.asarray(fitted.input_ids, np.int32)
            out[f"{name}_loss_mask"] = np.asarray(fitted.loss_mask, np.int8)
        out["prompt_length"] = prompt_len
        out["num_tokens"] = len(out["chosen_input_ids"]) + len(out["rejected_input_ids"])
        out["num_loss_tokens"] = int(out["chosen_loss_mask"].sum() + out["rejected_loss_mask"].sum())
        return EncodedRow(out, truncated)

    def _prompt(self, rec: PromptRecord, file, line) -> EncodedRow:
        ids = self.tok.encode_prompt(rec.prompt)
        if len(ids) > self.lengths.max_tokens_per_sample:
            # A truncated prompt asks a different question: never truncate, always refuse.
            raise too_long(len(ids), self.lengths, file, line, "prompt")
        try:
            extras = json.dumps(rec.extras, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise DataError(f"extra columns are not JSON-serializable: {e}", file=file,
                            line=line, field="<extras>", reason="wrong_type") from None
        return EncodedRow({"prompt_ids": np.asarray(ids, np.int32), "num_tokens": len(ids),
                           "num_loss_tokens": 0,
                           "prompt_messages": json.dumps(rec.prompt, ensure_ascii=False),
                           "extras": extras}, False)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n
