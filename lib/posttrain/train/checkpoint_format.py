"""What one checkpoint holds on disk, and how it is checked: the layout that
`posttrain.train.checkpoint.CheckpointManager` writes and reads, apart from its protocol
(collectives, the atomic commit, pruning, falling back past a damaged checkpoint)::

    step-00000042/
      dcp/               model + optimizer, torch.distributed.checkpoint (DCP), one file per rank
      meta.json          rank 0: step, saved world size, scheduler state, the caller's `extra`
      rank-00000.json    per rank: its RNG state (`capture_rng`) and its `rank_extra` (loader state)
      manifest.json      rank 0, last: every other file with its size and sha256

* **Names.** `step_name`, `rank_file`; `STEP_RE` matches a checkpoint directory, `TMP_RE` a
  local attempt that was never committed.
* **Non-tensor state is JSON** (`to_json`): a value JSON cannot hold, or a dict key it would
  silently turn into a string, is refused with a `CheckpointError` naming where it is.
* **The manifest** (`read_manifest`) lists every other file; `verify_file` checks one file's
  size and sha256 against it, and `size_of` is a complete checkpoint's bytes.
* **Frozen parameters** that are not saved are fingerprinted (`frozen_fingerprint`: sum and sum
  of squares in float64 over the full tensor), and `check_frozen` refuses a resume whose rebuilt
  ones differ.
* **Sizes** for the full-disk message: `tensor_bytes` of a state dict, `readable` bytes.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.train.checkpoint_storage import CheckpointError, Store

FORMAT = 1
MANIFEST = "manifest.json"
META = "meta.json"
DCP = "dcp"
STEP_RE = re.compile(r"^step-(\d{8})$")
TMP_RE = re.compile(r"^step-\d{8}\.tmp-.+$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _non_string_key(obj: Any, where: str = "") -> str | None:
    """The first dict key JSON would silently turn into a string, as a dotted path, or None."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{where}[{k!r}]"
            if found := _non_string_key(v, f"{where}.{k}" if where else k):
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            if found := _non_string_key(v, f"{where}[{i}]"):
                return found
    return None


def to_json(obj: Any, what: str) -> bytes:
    hint = "checkpoints store non-tensor state as JSON: plain numbers, strings, lists and dicts"
    try:
        blob = json.dumps(obj, sort_keys=True, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serializable ({e}); {hint}") from None
    if key := _non_string_key(obj):
        raise CheckpointError(f"{what} has a non-string dict key at {key}, which JSON would turn "
                              f"into a string; {hint} with string keys")
    return blob


# ---------------------------------------------------------------------------------- manifest

def read_manifest(store: Store, root: str) -> dict:
    """The manifest's ``files`` ({name: {size, sha256}}) of the checkpoint at `root`."""
    where = store.uri(f"{root}/{MANIFEST}")
    try:
        manifest = json.loads(store.read(f"{root}/{MANIFEST}"))
        files = manifest["files"]
        assert isinstance(files, dict) and manifest["format"] == FORMAT
    except FileNotFoundError:
        raise CheckpointError(f"{where}: manifest missing; the checkpoint is incomplete") \
            from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{where}: unreadable manifest ({type(e).__name__}: {e})") \
            from None
    return files


def verify_file(store: Store, root: str, name: str, want: dict) -> None:
    """Raise a CheckpointError naming file `name` unless it has the manifest's size and sha256."""
    where = store.uri(f"{root}/{name}")
    path = f"{root}/{name}"
    if not store.exists(path):
        raise CheckpointError(f"{where}: file missing (listed in the manifest)")
    size = store.size(path)
    if size != want["size"]:
        raise CheckpointError(f"{where}: size mismatch, {size} bytes but the manifest says "
                              f"{want['size']}")
    digest = store.sha256(path)
    if digest != want["sha256"]:
        raise CheckpointError(f"{where}: sha256 mismatch, file has {digest} but the manifest "
                              f"says {want['sha256']}")


def size_of(store: Store, path: str) -> int | None:
    """The bytes of a complete checkpoint: its manifest's file sizes and the manifest."""
    root = store.strip(path)
    with contextlib.suppress(CheckpointError, OSError):
        files = read_manifest(store, root)
        return sum(int(f["size"]) for f in files.values()) + store.size(f"{root}/{MANIFEST}")
    return None


# ------------------------------------------------------------------------- frozen parameters

def frozen_fingerprint(model: nn.Module) -> dict[str, list[float]]:
    """{name: [sum, sum of squares]} in float64 over the full tensor of every frozen parameter.

    Sharded parameters (DTensors) reduce over their mesh, so every rank gets the same numbers
    whatever the layout; a collective then, called by all ranks in the same order.
    """
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        with torch.no_grad():
            x = p.detach().to(torch.float64)
            sums = [x.sum(), x.square().sum()]
        out[name] = [float(v.full_tensor() if isinstance(v, DTensor) else v) for v in sums]
    return out


def check_frozen(uri: str, saved: dict[str, list[float]], now: dict[str, list[float]]) -> None:
    """Refuse a resume whose rebuilt frozen parameters are not those the checkpoint trained with."""
    hint = ("the run rebuilds frozen parameters (a LoRA base, a distillation teacher) from "
            "their source instead of saving them; was the base checkpoint replaced or the "
            "config changed since this run started?")
    if saved.keys() != now.keys():
        missing, extra = sorted(saved.keys() - now.keys()), sorted(now.keys() - saved.keys())
        raise CheckpointError(f"{uri}: the model's frozen parameters differ from the ones this "
                              f"checkpoint was trained with (missing {missing[:3]}, new "
                              f"{extra[:3]}); {hint}")
    for name, got in now.items():   # the model's order (meta.json's keys are sorted)
        want = saved[name]
        if any(abs(g - w) > 1e-9 * max(1.0, abs(w)) for g, w in zip(got, want)):
            raise CheckpointError(f"{uri}: frozen parameter {name} is not the one this "
                                  f"checkpoint was trained with (sum, sum of squares: saved "
                                  f"{want}, now {got}); {hint}")


# ------------------------------------------------------------------------------------ sizes

def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state dict; a DTensor counts its local shard."""
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def readable(n: int) -> str:
    for unit, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} bytes"
