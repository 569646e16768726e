"""Prepare: stream raw rows, validate, tokenize with loss masks, write tokenized Parquet shards.

For every source of every split (train, eval) this step streams rows with bounded memory
(local files, globs or ``s3://``), validates them for the configured format, renders chats with
the tokenizer's own chat template (ids identical to ``apply_chat_template``, loss mask on the
assistant turns), applies the over-long policy, and writes

    <output.dir>/<split>/<source>/part-NNNNN.parquet   tokenized rows
    <output.dir>/tokenizer/                            the tokenizer, with any added tokens
    <output.dir>/manifest.json                         counts, content hashes, length histograms
    <output.dir>/rejects.jsonl                         every rejected row: file, line, field, reason

Each source's rows may come in any shape its format reads (`posttrain.data.shapes`: for chat,
``messages``, ShareGPT, Alpaca, prompt/completion or ``text`` rows; ``.json`` files may hold one
array of rows): the shape is decided by the source's first row, or forced with ``shape:`` on
the source entry, and the manifest records it per source. A source whose first row fits no
shape stops the run (``unknown_shape``), with or without ``on_bad_row: skip``.

A bad row stops the run with a message naming file, line and field, or, with
``data.on_bad_row: skip``, is counted and reported. Invariant: rows read = written + rejected.
Besides malformed rows, these are bad rows: a row nested too deep (``too_deep``), a NaN or
infinite number where posttrain reads numbers (``non_finite``), a preference pair whose chosen
equals its rejected (``identical_pair``, unless ``data.allow_identical_pairs``), and a prompt row
without a column of ``data.required_columns`` (which the GRPO recipe fills with the columns its
reward functions read).

Event sequences (``vocab:`` instead of ``tokenizer:``, `posttrain.data.events`) take their ids
from the config's vocabulary, with the labels of extra heads as ``label_<name>`` columns; the
vocabulary is saved as ``tokenizer/event_vocab.json``.

Run it without Metaflow:

    posttrain prepare --config configs/prepare/sample_chat.yaml
    python -m steps.prepare --config configs/prepare/sample_chat.yaml
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from tqdm.auto import tqdm

from posttrain.config.loader import to_dict
from posttrain.config.recipes import PrepareConfig, load_recipe
from posttrain.data.encode import EncodedRow, RecordEncoder
from posttrain.data.events import EventEncoder, EventVocab
from posttrain.data.files import expand_paths
from posttrain.data.formats import RowParser
from posttrain.data.shapes import UnknownShape
from posttrain.data.shards import ShardWriter, join_uri
from posttrain.data.sources import RowStream, SourceConfig
from posttrain.data.tokenizer import ChatTokenizer
from posttrain.errors import DataError
from posttrain.process import existing_objects_frozen


@dataclass
class SourceReport:
    """What one source produced; `rows_read == rows_written + rows_rejected` always."""

    split: str
    name: str
    files: list[str]
    shape: str | None = None        # the rows' shape (posttrain.data.shapes); None: no rows
    rows_read: int = 0
    rows_written: int = 0
    rows_rejected: int = 0
    rows_truncated: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)
    shards: list[dict] = field(default_factory=list)
    num_tokens: int = 0
    num_loss_tokens: int = 0
    content_hash: str = ""
    length_histogram: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rejected_by_reason"] = dict(sorted(self.rejected_by_reason.items()))
        return d


def run(config: PrepareConfig | str | Path, *, overrides: dict | None = None,
        show_progress: bool = True) -> dict:
    """Prepare every split and source; return the manifest (also written to output.dir)."""
    cfg = config if isinstance(config, PrepareConfig) else \
        load_recipe(config, PrepareConfig, overrides)
    with existing_objects_frozen():        # the collector's full passes skip the libraries
        return _run(cfg, show_progress)


def _run(cfg: PrepareConfig, show_progress: bool) -> dict:
    started = time.time()
    tokenizer, encoder = _encoder(cfg)
    out_fs, out_root = fsspec.core.url_to_fs(cfg.output.dir)
    out_fs.makedirs(out_root, exist_ok=True)

    reports: list[SourceReport] = []
    # the vocabulary is written while the rows are encoded (saving only reads the tokenizer):
    # the other core is idle at the start and end of the pipeline, and the serialization
    # (0.07-0.13 s of 11 MB for Qwen's vocabulary) no longer follows the last shard
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="save-vocab") as pool:
        saved = pool.submit(_save_tokenizer, tokenizer, out_fs, out_root)
        with out_fs.open(f"{out_root}/rejects.jsonl", "w") as rejects:
            for split in ("train", "eval"):
                for i, source in enumerate(getattr(cfg.data, split)):
                    name = source.name or f"source{i}"
                    reports.append(_prepare_source(cfg, split, name, source, encoder, rejects,
                                                   show_progress))
        saved.result()
    manifest = _manifest(cfg, tokenizer, reports, time.time() - started)
    with out_fs.open(f"{out_root}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


class _TextEncoder:
    """Rows validated for the format in their source's shape (`RowParser`, one per source:
    `start_source`), then tokenized (`RecordEncoder`)."""

    def __init__(self, cfg: PrepareConfig, tokenizer: ChatTokenizer):
        self.fmt = cfg.data.format_config().with_template(tokenizer.hf)
        self.records = RecordEncoder(tokenizer, cfg.data.format, cfg.data.length_config())
        self.schema = self.records.schema
        self.rows = RowParser(self.fmt)

    def start_source(self, source: SourceConfig) -> None:
        self.rows = RowParser(self.fmt, source.shape)

    def encode_row(self, row: dict, *, file: str, line: int) -> EncodedRow:
        record = self.rows.parse(row, file=file, line=line)
        return self.records.encode(record, file=file, line=line)

    def encode_batches(self, batches: Iterable[list]
                       ) -> Iterator[tuple[list, list[EncodedRow | DataError]]]:
        """(raw rows, their results) for each batch of raw rows: each row's `encode_row`
        result or DataError in its place. Chat rows are tokenized a batch at a time, one
        batch's tokenization overlapping the next one's rendering
        (`RecordEncoder.encode_batches`)."""
        def parsed():
            for raws in batches:
                out: list[DataError | None] = []
                records = []
                for raw in raws:
                    try:
                        if raw.error is not None:
                            raise raw.error
                        records.append((self.rows.parse(raw.data, file=raw.file, line=raw.line),
                                        raw.file, raw.line))
                        out.append(None)
                    except DataError as err:
                        out.append(err)
                yield (raws, out), records

        for (raws, out), encoded in self.records.encode_batches(parsed()):
            it = iter(encoded)
            yield raws, [next(it) if r is None else r for r in out]


ROWS_PER_BATCH = 256     # rows tokenized per batch call; a few MB of text


def _batches(stream, size: int) -> Iterator[list]:
    batch = []
    for raw in stream:
        batch.append(raw)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(stream, encoder: _TextEncoder | EventEncoder):
    """(raw row, EncodedRow or DataError) in stream order; text rows go through the tokenizer
    in batches of ROWS_PER_BATCH."""
    if not isinstance(encoder, _TextEncoder):
        for raw in stream:
            try:
                if raw.error is not None:
                    raise raw.error
                yield raw, encoder.encode_row(raw.data, file=raw.file, line=raw.line)
            except DataError as err:
                yield raw, err
        return
    for raws, encoded in encoder.encode_batches(_batches(stream, ROWS_PER_BATCH)):
        yield from zip(raws, encoded)


def _encoder(cfg: PrepareConfig) -> tuple[ChatTokenizer | EventVocab, _TextEncoder | EventEncoder]:
    """The vocabulary (saved beside the shards, described in the manifest) and the row encoder:
    the tokenizer's, or for event sequences the config vocabulary's."""
    if cfg.vocab is not None:
        vocab = EventVocab(cfg.vocab)
        return vocab, EventEncoder(vocab, cfg.labels, cfg.data.length_config())
    tokenizer = ChatTokenizer(cfg.tokenizer)
    return tokenizer, _TextEncoder(cfg, tokenizer)


def _prepare_source(cfg: PrepareConfig, split: str, name: str, source: SourceConfig,
                    encoder: _TextEncoder | EventEncoder, rejects, show_progress: bool,
                    ) -> SourceReport:
    files = expand_paths(source.path)
    report = SourceReport(split, name, files)
    writer = ShardWriter(join_uri(cfg.output.dir, split, name), encoder.schema,
                         rows_per_shard=cfg.output.rows_per_shard)
    stream = RowStream(files, fmt=source.format, cache=cfg.cache)
    if isinstance(encoder, _TextEncoder):
        encoder.start_source(source)
    bar = tqdm(desc=f"prepare {split}/{name}", unit=" rows", disable=not show_progress,
               mininterval=1.0)
    try:
        for raw, encoded in _encoded(stream, encoder):
            report.rows_read += 1
            bar.update()
            if isinstance(encoded, DataError):
                err = encoded
                if isinstance(err, UnknownShape):    # the whole source: skipping cannot help
                    raise err
                if cfg.data.on_bad_row == "error":
                    raise DataError(f"{err.detail} (set data.on_bad_row: skip to count and "
                                    f"skip such rows)", file=err.file, line=err.line,
                                    field=err.field, reason=err.reason) from None
                report.rows_rejected += 1
                report.rejected_by_reason[err.reason] += 1
                rejects.write(json.dumps({"split": split, "source": name, **err.to_record()})
                              + "\n")
                continue
            writer.write(encoded.columns)
            report.rows_written += 1
            report.rows_truncated += int(encoded.truncated)
    finally:
        bar.close()
        close = getattr(stream, "close", None)
        if close:
            close()
    report.shape = encoder.rows.shape if isinstance(encoder, _TextEncoder) else "sequence"
    report.shards = [s.__dict__ for s in writer.close()]
    report.num_tokens, report.num_loss_tokens = writer.num_tokens, writer.num_loss_tokens
    report.content_hash = writer.content_hash
    report.length_histogram = writer.histogram.to_dict()
    assert report.rows_read == report.rows_written + report.rows_rejected
    return report


def _save_tokenizer(tokenizer: ChatTokenizer | EventVocab, fs, root: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        fs.makedirs(f"{root}/tokenizer", exist_ok=True)
        for path in sorted(Path(tmp).iterdir()):
            fs.put_file(str(path), f"{root}/tokenizer/{path.name}")


def _manifest(cfg: PrepareConfig, tokenizer: ChatTokenizer | EventVocab,
              reports: list[SourceReport], seconds: float) -> dict:
    resolved = to_dict(cfg)
    config_hash = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()
    dataset_hash = hashlib.sha256("".join(
        f"{r.split}/{r.name}:{r.content_hash};" for r in reports).encode()).hexdigest()
    totals = {k: sum(getattr(r, k) for r in reports) for k in
              ("rows_read", "rows_written", "rows_rejected", "rows_truncated", "num_tokens",
               "num_loss_tokens")}
    return {
        "format": cfg.data.format,
        "output_dir": cfg.output.dir,
        "content_hash": dataset_hash,
        "config_hash": config_hash,
        "config": resolved,
        "tokenizer": tokenizer.describe(),
        "totals": totals,
        "sources": [r.to_dict() for r in reports],
        "seconds": round(seconds, 3),
    }


def summarize(manifest: dict) -> str:
    """A short human-readable table of what was produced."""
    lines = [f"prepared {manifest['format']} data -> {manifest['output_dir']}",
             f"{'split/source':<28}{'shape':<18}{'read':>8}{'written':>9}{'rejected':>10}"
             f"{'truncated':>11}{'tokens':>11}{'loss tok':>10}"]
    for s in manifest["sources"]:
        lines.append(f"{s['split'] + '/' + s['name']:<28}{s['shape'] or '-':<18}"
                     f"{s['rows_read']:>8}"
                     f"{s['rows_written']:>9}{s['rows_rejected']:>10}{s['rows_truncated']:>11}"
                     f"{s['num_tokens']:>11}{s['num_loss_tokens']:>10}")
        if s["rejected_by_reason"]:
            lines.append(f"{'':<4}rejected: " + ", ".join(
                f"{k}={v}" for k, v in s["rejected_by_reason"].items()))
    t = manifest["totals"]
    tok = manifest["tokenizer"]
    lines += [f"totals: {t['rows_read']} read = {t['rows_written']} written + "
              f"{t['rows_rejected']} rejected; {t['num_tokens']} tokens "
              f"({t['num_loss_tokens']} in the loss)",
              f"tokenizer: vocab_size={tok.get('vocab_size')}",
              f"content hash: {manifest['content_hash'][:16]}…  "
              f"manifest: {manifest['output_dir']}/manifest.json  "
              f"rejects: {manifest['output_dir']}/rejects.jsonl"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    overrides = {"output.dir": args.output_dir} if args.output_dir else None
    manifest = run(args.config, overrides=overrides, show_progress=not args.no_progress)
    print(summarize(manifest))
    return 0


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["prepare", *sys.argv[1:]]))
