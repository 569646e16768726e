"""Atomic, sharded, resumable training checkpoints on a local disk or an object store.

One checkpoint is one directory (or s3 prefix) named after its step, ``step-00000042/``: DCP's
model and optimizer shards, ``meta.json``, one ``rank-NNNNN.json`` per rank (its RNG state and
`rank_extra`), and ``manifest.json`` (every other file's size and sha256), written last; the
layout, the manifest check and the frozen-parameter fingerprint are `checkpoint_format.py`.

Model and optimizer go through `get_state_dict`/`set_state_dict`, so the same code saves a plain
module and an FSDP2 (`fully_shard`) model; each rank writes only its own shards, and DCP reshards
on load when the number of processes changed. Everything that is not a tensor is JSON.

Frozen parameters (`requires_grad=False`: a LoRA run's base weights, an online distillation
teacher) are not saved by default (`save_frozen=False`): training never changes them and the
run rebuilds them from their source (the base checkpoint, a seeded init) before it loads, so a
LoRA checkpoint of an 8B model holds megabytes of adapters and optimizer state instead of the
16 GB base again, every save. Loading restores frozen parameters when the checkpoint has them
and leaves them as built when it does not; every trainable parameter must be in the checkpoint
either way. So that a replaced base is not picked up silently, `meta.json` then keeps a
fingerprint of each frozen parameter (its sum and sum of squares in float64, over the full
tensor), and a load whose rebuilt frozen parameters do not match fails naming the first one.

Atomicity. A save writes into ``step-00000042.tmp-<nonce>/``; after all ranks are done and have
hashed their share of the files, rank 0 writes the manifest and commits with one ``os.rename``.
S3 has no rename, so there the files are written in place and the manifest, a single PUT written
last, is the commit marker: a prefix without a manifest is incomplete and ignored. Either way a
crash at any point leaves the previous checkpoints untouched, and the next successful save
deletes what the dead attempt left behind. (One exception: saving a step that already exists as
a complete checkpoint replaces it, and a crash in that window loses that step, not older ones.)
DCP writes to s3 directly through its fsspec writer,
so no local staging copy (and no local disk the size of a shard) is needed.

A full disk. A save that runs out of space (ENOSPC, or EDQUOT: a quota) anywhere (DCP's shard
or index, a JSON file, the manifest, the commit rename) fails on every rank with a
`CheckpointError` that names the checkpoint, the file being written and the bytes the save
needs: the size of the previous checkpoint (its manifest's file sizes; the same model and
optimizer write the same shapes), or where there is none, or it is smaller, the sum over ranks
of the tensors' bytes each writes (its shards of the model and optimizer state) and of the JSON
files, which leaves out DCP's index and per-tensor headers (about 6% of a tiny model's
checkpoint). The partial attempt is removed (it is never loaded either
way, having no manifest or no final name), so the space it took is free again, and the message
says how much is free and which checkpoint a restart resumes from: the previous one, untouched.

Loading picks the newest checkpoint whose files match its manifest; a damaged newest checkpoint
is reported with a warning that names the file, and the previous one is used.

Outages. On an object store every file operation is retried after a transient error
(`CheckpointConfig.retry`, see `checkpoint_storage.py`), and a DCP save or load that fails on one
runs again as a whole, all ranks together (DCP overwrites the same files, or reads them again).
So a save that overlaps a short outage of the store still commits a complete checkpoint; one
that outlasts the retries fails with `CheckpointStorageError`, and a load then fails the same
way rather than falling back to an older checkpoint or to none.

Unpickling. DCP stores its index (``dcp/.metadata``) as a pickle and reads small non-tensor
values (optimizer hyper-parameters) with ``torch.load(weights_only=False)``. Here the index is
read with an unpickler that only admits DCP's own metadata classes, and every small value must
first load with ``weights_only=True``; both files are also checked against the manifest first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from posttrain.errors import ConfigError
from posttrain.retry import Backoff, RetryConfig
from posttrain.train.checkpoint_format import (DCP, FORMAT, MANIFEST, META, STEP_RE, TMP_RE,
                                            check_frozen, frozen_fingerprint, rank_file,
                                            read_manifest, readable, size_of, step_name,
                                            tensor_bytes, to_json, verify_file)
from posttrain.train.checkpoint_storage import (CheckpointError, CheckpointStorageError,
                                             SafeLoadPlanner, Store, dcp_failure, no_space,
                                             transient_dcp_error)
from posttrain.train.rng import capture_rng, restore_rng as _restore_rng

__all__ = ["Checkpoint", "CheckpointConfig", "CheckpointError", "CheckpointManager",
           "CheckpointStorageError"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and how many survive.

    `dir` is a local directory or an ``s3://bucket/prefix``; `every_steps` is the save interval in
    optimizer steps (see `CheckpointManager.due`); `keep_last` complete checkpoints are kept;
    `retry` is how an object store's transient errors are retried (see "Outages" above).
    """

    dir: str
    every_steps: int = 100
    keep_last: int = 3
    save_frozen: bool = False   # also write parameters with requires_grad=False (see above)
    retry: RetryConfig = RetryConfig()

    def __post_init__(self):
        if not self.dir:
            raise ConfigError("checkpoint.dir: must name a local directory or an s3:// prefix")
        if self.every_steps < 1:
            raise ConfigError(f"checkpoint.every_steps: must be >= 1, got {self.every_steps}")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last: must be >= 1, got {self.keep_last}")


@dataclass
class Checkpoint:
    """A complete checkpoint. `meta` is filled by `load` (extra, rank_extra, world_size)."""

    path: str
    step: int
    meta: dict = field(default_factory=dict)


class CheckpointManager:
    """Saves, lists, verifies and loads the checkpoints under `cfg.dir`.

    With `world_size > 1`, `save` and `load` are collectives: every rank calls them, in the same
    order, with a torch.distributed process group initialized (with NCCL, after
    `torch.cuda.set_device`, since small Python objects travel through `all_gather_object`).
    The directory must be shared by all ranks (a shared file system or s3).
    """

    def __init__(self, cfg: CheckpointConfig, *, rank: int = 0, world_size: int = 1,
                 storage_options: dict | None = None):
        if not 0 <= rank < world_size:
            raise ConfigError(f"CheckpointManager: rank {rank} is outside world_size {world_size}")
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self._store = Store(cfg.dir, dict(storage_options or {}), cfg.retry)

    def due(self, step: int) -> bool:
        """Whether `step` is a save step under `cfg.every_steps`."""
        return step > 0 and step % self.cfg.every_steps == 0

    # -- collectives ----------------------------------------------------------------------------

    def _check_group(self) -> None:
        if self.world_size == 1:
            return
        if not dist.is_initialized():
            raise ConfigError(f"CheckpointManager: world_size={self.world_size} needs an "
                              "initialized torch.distributed process group")
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ConfigError(f"CheckpointManager: rank/world_size {self.rank}/{self.world_size} "
                              f"disagree with the process group's {dist.get_rank()}/"
                              f"{dist.get_world_size()}")

    def _gather(self, obj: Any) -> list:
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @contextmanager
    def _quiet_single_process(self):
        # DCP warns that it assumes one process even when told so with no_dist=True.
        with warnings.catch_warnings():
            if self.world_size == 1:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # -- save -----------------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
             scheduler=None, extra: dict | None = None, rank_extra: dict | None = None) -> str:
        """Write checkpoint `step` atomically, prune to `keep_last`, and return its path."""
        self._check_group()
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        # a collective on sharded models, so outside the per-rank checks below
        frozen = None if self.cfg.save_frozen else frozen_fingerprint(model)
        try:
            rank_blob = to_json({"rank": self.rank, "rng": capture_rng(), "extra": rank_extra},
                                 f"rank_extra (rank {self.rank})")
            meta_blob = b""
            if self.rank == 0:
                sched_sd = None if scheduler is None else scheduler.state_dict()
                to_json(extra, "extra")
                to_json(sched_sd, "scheduler.state_dict()")
                meta_blob = to_json({"format": FORMAT, "step": step,
                                      "world_size": self.world_size,
                                      "has_optimizer": optimizer is not None,
                                      "has_frozen": self.cfg.save_frozen,
                                      "frozen_fingerprint": frozen,
                                      "scheduler": sched_sd, "extra": extra}, "meta")
            problem = None
        except CheckpointError as e:
            problem = str(e)
        # One collective agrees on the attempt's nonce and fails every rank if any input is bad.
        answers = self._gather((problem, secrets.token_hex(6)))
        if bad := [p for p, _ in answers if p]:
            raise CheckpointError(bad[0])
        nonce = answers[0][1]

        name = step_name(step)
        final = self._store.join(name)
        work = final if self._store.remote else self._store.join(f"{name}.tmp-{nonce}")
        if self.rank == 0:
            if self._store.remote:
                self._store.remove_tree(final)  # a dead attempt at this step, or a replaced one
            self._store.makedirs(work)
        self._barrier()

        state = self._state_dict(model, optimizer, self.cfg.save_frozen)
        writing = f"{work}/{DCP}"
        try:
            self._dcp(writing, lambda: dcp.save(
                state, storage_writer=self._store.dcp_writer(f"{work}/{DCP}"),
                no_dist=self.world_size == 1))
            writing = f"{work}/{rank_file(self.rank)}"
            _write_file(self._store, writing, rank_blob)
            if self.rank == 0:
                writing = f"{work}/{META}"
                _write_file(self._store, writing, meta_blob)
            full = None
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if (cause := no_space(e)) is None:
                raise
            full = (self._store.uri(writing), str(cause))
        # In place of a barrier: a full disk on any rank fails them all, with the save's size.
        outcomes = self._gather((full, tensor_bytes(state) + len(rank_blob) + len(meta_blob)))
        needed = sum(size for _, size in outcomes)
        if fulls := [f for f, _ in outcomes if f]:
            self._fail_no_space(step, work, fulls[0], needed)

        # Each rank hashes a share of the files, so no rank reads the whole checkpoint.
        names = [n for n in self._store.files(work) if n != MANIFEST]
        mine = {n: {"size": self._store.size(f"{work}/{n}"),
                    "sha256": self._store.sha256(f"{work}/{n}")}
                for n in names[self.rank::self.world_size]}
        shares = self._gather(mine)
        if self.rank == 0:
            files = {k: v for share in shares for k, v in share.items()}
            assert sorted(files) == names, "every file must be hashed by exactly one rank"
            manifest = {"format": FORMAT, "step": step, "world_size": self.world_size,
                        "files": files}
            writing = f"{work}/{MANIFEST}"
            try:
                _write_file(self._store, writing, to_json(manifest, "manifest"))
                writing = final
                self._store.commit(work, final, nonce)
            except OSError as e:
                if (cause := no_space(e)) is None:
                    raise
                full = (self._store.uri(writing), str(cause))
            else:
                self._prune()
        if full := self._gather(full)[0]:        # rank 0's outcome, in place of a barrier
            self._fail_no_space(step, work, full, needed)
        return self._store.uri(final)

    def _fail_no_space(self, step: int, work: str, full: tuple[str, str], needed: int) -> None:
        """Remove the attempt at `step` (rank 0) and raise on every rank, naming the checkpoint,
        the file being written (`full`: where, the OS's error) and the bytes the save needs."""
        if self.rank == 0:
            with contextlib.suppress(OSError, CheckpointError):
                self._store.remove_tree(work)
        self._barrier()
        where, why = full
        free = ""
        if not self._store.remote:
            free = (f"; {shutil.disk_usage(self._store.root).free:,} bytes are free there now, "
                    "with the partial attempt removed")
        previous = self.latest()
        resume = (f"the previous checkpoint, {previous.path}, which is untouched"
                  if previous else "the start: no checkpoint has been saved yet")
        basis = "its tensors and state files; DCP's index adds a little"
        if previous and (size := size_of(self._store, previous.path)) and size >= needed:
            needed, basis = size, "the size of the previous checkpoint"
        raise CheckpointError(
            f"checkpoint {self._store.uri(self._store.join(step_name(step)))} could not be "
            f"saved: {why} (writing {where}). The save needs about {needed:,} bytes "
            f"({readable(needed)}: {basis}){free}. Free that much space (or point the run at "
            f"a larger disk) and start the run again: it resumes from {resume}.")

    def _dcp(self, path: str, run: Callable[[], Any]) -> None:
        """A DCP save or load (`run`), run again as a whole after a transient error of the
        object store; every rank says how its attempt went, so all retry or stop together."""
        if not self._store.remote:
            with self._quiet_single_process():
                run()
            return
        backoff = Backoff(self.cfg.retry, self._store.uri(path), log)
        while True:
            error = None
            try:
                with self._quiet_single_process():
                    run()
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                error = e
            transient = error is not None and transient_dcp_error(error)
            outcomes = self._gather("ok" if error is None else
                                    "transient" if transient else "failed")
            if set(outcomes) == {"ok"}:
                return
            if "failed" in outcomes:
                if error is not None:
                    raise error
                raise CheckpointError(f"{self._store.uri(path)}: rank {outcomes.index('failed')} "
                                      "failed to write or read its part (see its log)")
            cause = None if error is None else dcp_failure(error)
            delay = backoff.next_delay()
            if any(self._gather(delay is None)):   # one rank's spent budget stops them all
                last = cause or RuntimeError(f"rank {outcomes.index('transient')} failed")
                raise CheckpointStorageError(str(backoff.give_up(last))) from error
            backoff.wait(delay, cause)

    @staticmethod
    def _state_dict(model: nn.Module, optimizer, frozen: bool) -> dict:
        opts = StateDictOptions(ignore_frozen_params=not frozen)
        if optimizer is None:
            return {"model": get_model_state_dict(model, options=opts)}
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        return {"model": model_sd, "optim": optim_sd}

    def _prune(self) -> None:
        complete = self._complete_names()
        for name in complete[:-self.cfg.keep_last]:
            victim = self._store.join(name)
            if not self._store.remote:  # out of the listing at once, then deleted
                hidden = f"{victim}.tmp-pruned-{secrets.token_hex(4)}"
                os.rename(victim, hidden)
                victim = hidden
            self._store.remove_tree(victim)
        keep = set(complete)
        for name in self._store.listdir():
            # Saves are synchronous, so after a commit every other unfinished directory is dead.
            if TMP_RE.match(name) or (STEP_RE.match(name) and name not in keep):
                dead = self._store.join(name)
                log.info("removing unfinished checkpoint attempt %s", self._store.uri(dead))
                self._store.remove_tree(dead)

    # -- list / verify --------------------------------------------------------------------------

    def _complete_names(self) -> list[str]:
        names = [n for n in self._store.listdir() if STEP_RE.match(n)]
        return [n for n in names if self._store.exists(self._store.join(n, MANIFEST))]

    def list(self) -> list[Checkpoint]:
        """Complete checkpoints (those with a manifest), oldest first. Not verified."""
        return [Checkpoint(path=self._store.uri(self._store.join(n)),
                           step=int(STEP_RE.match(n)[1])) for n in self._complete_names()]

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None. Not verified; `load` verifies."""
        found = self.list()
        return found[-1] if found else None

    def verify(self, path: str) -> None:
        """Check every file of the checkpoint at `path` against its manifest.

        Raises CheckpointError naming the file: manifest missing or unreadable, a listed file
        missing, or its size or sha256 different from the manifest's.
        """
        root = self._store.strip(path)
        files = read_manifest(self._store, root)
        for name in sorted(files):
            verify_file(self._store, root, name, files[name])

    def _verify_collective(self, root: str) -> CheckpointError | None:
        """Verify with every rank checking a share of the files; all ranks get the same answer.
        An unreachable store raises (`CheckpointStorageError`) instead of calling it damage."""
        problem = None
        try:
            files = read_manifest(self._store, root)
            for name in sorted(files)[self.rank::self.world_size]:
                verify_file(self._store, root, name, files[name])
        except CheckpointError as e:
            problem = (type(e) is CheckpointStorageError, str(e))
        problems = [p for p in self._gather(problem) if p]
        # An unreachable store says nothing about the checkpoint: no falling back past it.
        if unreachable := [message for storage, message in problems if storage]:
            raise CheckpointStorageError(unreachable[0])
        return CheckpointError(problems[0][1]) if problems else None

    # -- load -----------------------------------------------------------------------------------

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             scheduler=None, path: str | None = None,
             restore_rng: bool = True) -> Checkpoint | None:
        """Load into `model`/`optimizer`/`scheduler` in place and restore this rank's RNG.

        `path=None` takes the newest checkpoint that verifies, warning about and skipping damaged
        newer ones; returns None when there is none. An explicit `path` that fails verification
        raises CheckpointError. `meta` of the result holds `extra`, this rank's `rank_extra`
        (None when this rank did not exist at save time), the saved `world_size` and
        `world_size_changed`.
        """
        self._check_group()
        if path is not None:
            root = self._store.strip(path)
            if err := self._verify_collective(root):
                raise err
            return self._load_from(root, model, optimizer, scheduler, restore_rng)
        # Rank 0's listing decides, so all ranks walk the same candidates.
        candidates = self._gather(self._complete_names() if self.rank == 0 else None)[0]
        for name in reversed(candidates):
            root = self._store.join(name)
            err = self._verify_collective(root)
            if err is None:
                return self._load_from(root, model, optimizer, scheduler, restore_rng)
            if self.rank == 0:
                log.warning("checkpoint %s is damaged and will not be loaded: %s; falling back to "
                            "the previous checkpoint", self._store.uri(root), err)
        return None

    def _load_from(self, root: str, model, optimizer, scheduler, restore_rng: bool) -> Checkpoint:
        uri = self._store.uri(root)
        meta = json.loads(self._store.read(f"{root}/{META}"))
        saved_ws = meta["world_size"]
        if optimizer is not None and not meta["has_optimizer"]:
            raise CheckpointError(f"{uri}: holds no optimizer state, but load was given an "
                                  "optimizer")
        if scheduler is not None and meta["scheduler"] is None:
            raise CheckpointError(f"{uri}: holds no scheduler state, but load was given a "
                                  "scheduler")

        # checkpoints from before `has_frozen` existed hold every parameter
        has_frozen = meta.get("has_frozen", True)
        if not has_frozen and meta.get("frozen_fingerprint") is not None:
            check_frozen(uri, meta["frozen_fingerprint"], frozen_fingerprint(model))
        state = self._state_dict(model, optimizer, has_frozen)
        self._dcp(f"{root}/{DCP}", lambda: dcp.load(
            state, storage_reader=self._store.dcp_reader(f"{root}/{DCP}"),
            planner=SafeLoadPlanner(), no_dist=self.world_size == 1))
        # DCP has filled every key of `state` (a key the checkpoint lacks is an error there), so
        # the keys left out are exactly the frozen parameters, which stay as the model has them.
        opts = StateDictOptions(ignore_frozen_params=not has_frozen, strict=has_frozen)
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=opts)
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        if scheduler is not None:
            scheduler.load_state_dict(meta["scheduler"])

        rank_state = None
        if self.rank < saved_ws:
            rank_state = json.loads(self._store.read(f"{root}/{rank_file(self.rank)}"))
        if restore_rng:
            if rank_state is not None:
                _restore_rng(rank_state["rng"])
            else:
                log.warning("%s: rank %d did not exist in the saved world of %d; its RNG is not "
                            "restored", uri, self.rank, saved_ws)
        changed = saved_ws != self.world_size
        if changed and self.rank == 0:
            log.warning("%s was saved by %d processes and is loaded by %d: model and optimizer are "
                        "resharded; per-rank state (rank_extra, RNG) exists only for ranks < %d",
                        uri, saved_ws, self.world_size, saved_ws)
        return Checkpoint(path=uri, step=meta["step"], meta={
            "extra": meta["extra"],
            "rank_extra": None if rank_state is None else rank_state["extra"],
            "world_size": saved_ws,
            "world_size_changed": changed,
        })


def _write_file(store: Store, path: str, data: bytes) -> None:
    """All non-DCP checkpoint files go through here (tests interrupt saves at this point)."""
    store.write(path, data)
