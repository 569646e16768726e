"""A local view of a prepared dataset that lives in an object store.

`prepare` writes ``manifest.json``, ``tokenizer/`` and the Parquet shards under one directory,
local or ``s3://``. The shards are streamed from wherever they are (the manifest holds their
full URIs), but a few readers want plain local files: the tokenizer (Hugging Face loads from
a directory), and code that reads the manifest with `pathlib`. `local_view` copies just those
small files into a local cache directory and returns it; a local directory is returned as is.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import fsspec

_SMALL_FILES = ("manifest.json", "rejects.jsonl")


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def local_view(prepared_dir: str, cache_dir: str | None = None) -> str:
    """A local directory with the manifest and tokenizer of `prepared_dir` (shards stay remote).

    The copy is keyed by the URI and refreshed when the remote manifest changes, so concurrent
    or repeated calls on one machine share it.
    """
    if not is_remote(prepared_dir):
        return str(prepared_dir)
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    root = root.rstrip("/")
    with fs.open(f"{root}/manifest.json", "rb") as f:
        manifest = f.read()
    key = hashlib.sha256(prepared_dir.encode()).hexdigest()[:16]
    base = Path(cache_dir or os.path.join(tempfile.gettempdir(), "posttrain-prepared"))
    out = base / key
    if (out / "manifest.json").is_file() and (out / "manifest.json").read_bytes() == manifest:
        return str(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_mkdir(base)))
    for name in _SMALL_FILES[1:]:
        if fs.exists(f"{root}/{name}"):
            fs.get_file(f"{root}/{name}", str(tmp / name))
    (tmp / "tokenizer").mkdir()
    for path in fs.ls(f"{root}/tokenizer", detail=False):
        fs.get_file(path, str(tmp / "tokenizer" / path.rstrip("/").rsplit("/", 1)[-1]))
    (tmp / "manifest.json").write_bytes(manifest)      # last: a complete view has a manifest
    if out.exists():
        _replace(out, tmp)
    else:
        try:
            tmp.rename(out)
        except OSError:                                 # another process won the race
            _replace(out, tmp)
    return str(out)


def _mkdir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _replace(out: Path, tmp: Path) -> None:
    import shutil
    old = out.with_name(out.name + f".old-{os.getpid()}")
    try:
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
