"""Scheduled retraining: the newest data snapshot, an SFT recipe, and a promotion gate.

A snapshot root holds one directory per data snapshot, named so that names sort by age (e.g.
``2026-11-30``), each with the train and eval files::

    s3://bucket/chat-snapshots/2026-11-29/{train,eval}.jsonl
    s3://bucket/chat-snapshots/2026-11-30/{train,eval}.jsonl      <- newest: trained on

`flows/retrain_flow.py` (``@schedule``) picks the newest complete snapshot, trains the SFT recipe
on it, evaluates the candidate and the currently promoted model on the snapshot's eval split and
moves the ``promoted`` tag only when `posttrain.promotion.decide` says so.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import fsspec

from posttrain.errors import DataError
from posttrain.promotion import GateConfig

__all__ = ["RetrainConfig", "SnapshotConfig", "newest_snapshot"]


@dataclass(frozen=True)
class SnapshotConfig:
    root: str                          # local directory or s3:// prefix of snapshot directories
    train_file: str = "train.jsonl"
    eval_file: str = "eval.jsonl"


@dataclass(frozen=True)
class RetrainConfig:
    recipe: str                        # the SFT recipe YAML (its data paths are replaced)
    snapshots: SnapshotConfig
    gate: GateConfig = GateConfig(metric="eval_loss", mode="min", margin=0.0)


def newest_snapshot(cfg: SnapshotConfig) -> dict[str, Any]:
    """The newest snapshot with both files: {name, train, eval, sha256 of the two files}."""
    fs, root = fsspec.core.url_to_fs(cfg.root)
    if not fs.isdir(root):
        raise DataError(f"snapshot root {cfg.root} does not exist or is not a directory")
    names = sorted((p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)
                    if fs.isdir(p)), reverse=True)
    for name in names:
        train, evals = f"{root}/{name}/{cfg.train_file}", f"{root}/{name}/{cfg.eval_file}"
        if fs.isfile(train) and fs.isfile(evals):
            digest = hashlib.sha256()
            for path in (train, evals):
                with fs.open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
            protocol = "" if cfg.root.startswith("/") or "://" not in cfg.root else \
                cfg.root.split("://", 1)[0] + "://"
            return {"name": name, "train": protocol + train, "eval": protocol + evals,
                    "sha256": digest.hexdigest()}
    raise DataError(f"no snapshot under {cfg.root} has both {cfg.train_file} and "
                    f"{cfg.eval_file} (looked at {names[:5]})")
