"""Teacher top-k: run the teacher once over the prepared train rows, store its top-k log-probs.

    prepared shards -> rows packed into one sequence per forward (document-masked attention)
    -> teacher hidden states -> at each label position, chunk by chunk: log-softmax over the
    real vocabulary -> top-k ids and log-probs -> `<prepared>/teacher_topk/<source>/*.parquet`
    (one file per prepared shard, same rows in the same order) -> manifest.json (written last)

An offline distillation run (`teacher.signal: offline`) then reads these rows with
`posttrain.data.topk.TopkLoader` instead of running the teacher each step. The pass runs the
teacher in this one process (on the GPU when there is one); a teacher that does not fit one
device needs the online signal. The manifest records k, the teacher and the prepared data's
content hash, and `run` returns at once when they match what is already there.

    python -m steps.teacher_topk --teacher runs/teacher/hf --prepared-dir runs/distill/prepared
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from posttrain.data.loader import sources_from_manifest
from posttrain.data.prepared import local_view
from posttrain.data.sources import RowStream
from posttrain.data.topk import TOPK_DIR, label_positions, read_topk_manifest
from posttrain.models.auto import load_model
from posttrain.models.transformer import Transformer

SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                    ("topk_ids", pa.list_(pa.int32())), ("topk_logps", pa.list_(pa.float32()))])


def run(teacher_dir: str, prepared_dir: str, *, k: int, tokens_per_forward: int = 8192,
        chunk_tokens: int = 1024) -> dict[str, Any]:
    """Write the top-k files (unless the same ones are there) and return their manifest."""
    from posttrain.train.distill import check_teacher
    local = local_view(prepared_dir)
    prepared = json.loads(open(f"{local}/manifest.json").read())
    check_teacher(teacher_dir, teacher_dir, f"{local}/tokenizer")
    want = {"k": k, "teacher": str(teacher_dir), "content_hash": prepared["content_hash"]}
    old = read_topk_manifest(prepared_dir)
    if old is not None and {key: old.get(key) for key in want} == want:
        return old
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher = load_model(teacher_dir, device=device, dtype=torch.float32).eval()
    root = f"{prepared_dir.rstrip('/')}/{TOPK_DIR}"
    sources, rows = [], 0
    for name, shards in sorted(sources_from_manifest(prepared_dir, "train").items()):
        files = []
        for i, shard in enumerate(shards):
            out = f"{root}/{name}/part-{i:05d}.parquet"
            rows += _write_shard(teacher, shard, out, k, tokens_per_forward, chunk_tokens)
            files.append(out)
        sources.append({"name": name, "files": files})
    manifest = {**want, "rows": rows, "sources": sources}
    with fsspec.open(f"{root}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def _write_shard(teacher: Transformer, shard: str, out: str, k: int, tokens_per_forward: int,
                 chunk_tokens: int) -> int:
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    columns: dict[str, list] = {name: [] for name in SCHEMA.names}

    def flush() -> None:
        for (ids, mask), (top_ids, top_logps) in zip(rows, _topk(teacher, rows, k, chunk_tokens)):
            columns["input_ids"].append(ids)
            columns["loss_mask"].append(mask)
            columns["topk_ids"].append(top_ids.reshape(-1))
            columns["topk_logps"].append(top_logps.reshape(-1))
        rows.clear()

    with RowStream([shard], fmt="parquet") as stream:
        for raw in stream:
            if raw.error is not None:
                raise raw.error
            ids = np.asarray(raw.data["input_ids"], np.int32)
            if rows and sum(len(r[0]) for r in rows) + len(ids) > tokens_per_forward:
                flush()
            rows.append((ids, np.asarray(raw.data["loss_mask"], np.uint8)))
    if rows:
        flush()
    table = pa.table({name: pa.array(columns[name], type=SCHEMA.field(name).type)
                      for name in SCHEMA.names}, schema=SCHEMA)
    with fsspec.open(out, "wb") as f:
        pq.write_table(table, f)
    return table.num_rows


@torch.no_grad()
def _topk(teacher: Transformer, rows: list[tuple[np.ndarray, np.ndarray]], k: int,
          chunk_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row, [m, k] top-k ids and log-probs at its m label positions (one packed forward)."""
    device = teacher.head.weight.device
    lengths = [len(ids) for ids, _ in rows]
    input_ids = torch.from_numpy(np.concatenate([ids for ids, _ in rows]).astype(np.int64))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    hidden = teacher(input_ids[None].to(device), position_ids[None].to(device), [lengths])[0]
    starts = np.cumsum([0] + lengths[:-1])
    picked = torch.from_numpy(np.concatenate(
        [start + label_positions(mask) for start, (_, mask) in zip(starts, rows)]).astype(np.int64))
    h = hidden.index_select(0, picked.to(device))
    head = teacher.head
    weight = head.weight[:head.real_vocab_size]
    ids_out, logps_out = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        logp = torch.log_softmax(F.linear(h[s:s + chunk_tokens], weight).float(), dim=-1)
        top = logp.topk(k, dim=-1)
        ids_out.append(top.indices.to(torch.int32).cpu())
        logps_out.append(top.values.cpu())
    all_ids = torch.cat(ids_out).numpy() if ids_out else np.zeros((0, k), np.int32)
    all_logps = torch.cat(logps_out).numpy() if logps_out else np.zeros((0, k), np.float32)
    out, at = [], 0
    for _, mask in rows:
        m = len(label_positions(mask))
        out.append((all_ids[at:at + m], all_logps[at:at + m]))
        at += m
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steps.teacher_topk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="teacher HF checkpoint directory")
    p.add_argument("--prepared-dir", required=True)
    p.add_argument("--k", type=int, default=32)
    a = p.parse_args(argv)
    manifest = run(a.teacher, a.prepared_dir, k=a.k)
    print(f"top-{manifest['k']} teacher log-probs for {manifest['rows']} rows under "
          f"{a.prepared_dir}/{TOPK_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
