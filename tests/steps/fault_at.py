"""Run a training step's CLI (inline launcher) with one fault at the N-th time it reaches a point.

    python tests/steps/fault_at.py FAULT POINT:N MARKER MODULE [CLI arguments...]

FAULT is `kill` (SIGKILL: the machine died) or `enospc` (only inside a save: the file being
written is cut to half and `OSError(ENOSPC)` raised, as a full disk does). POINT is one of

  load         the training loop has taken a micro-batch from the loader (collated, not used);
  forward      the loss root's forward over a micro-batch has run (training, or held-out
               evaluation after it), its backward not yet;
  optimizer    inside an optimizer step: the weights are updated, the scheduler and the step
               counter not yet;
  save/dcp     inside a checkpoint save: DCP has written the model and optimizer shard, which
               is then cut to half its size (a torn shard), before anything else;
  save/rank-00000.json, save/meta.json, save/manifest.json
               inside a checkpoint save: half of that file is written;
  save/commit  inside a checkpoint save: every file is written and hashed, the directory not
               yet renamed into place;

and N counts the times this process reached it (1-based): `forward:7` is the 7th forward,
`save/commit:5` the 5th save (checkpoint 5 of a fresh run that saves every step). Before the
fault, one JSON line is appended to MARKER: the point, N and `step`, the optimizer steps the
engine had completed (the step in progress is step + 1), so a test can check where it hit.
Nothing in the library knows about this: the hooks are patched in here, in the child process,
and a run without them pays nothing.
"""

from __future__ import annotations

import errno
import json
import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))       # `steps` from the checkout

from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from posttrain.train import checkpoint as ckpt  # noqa: E402
from posttrain.train import checkpoint_storage as storage  # noqa: E402
from posttrain.train.engine import Engine  # noqa: E402
from posttrain.train.recipe import RecipeWorker  # noqa: E402

POINTS = ("load", "forward", "optimizer", "save/dcp", "save/rank-00000.json", "save/meta.json",
          "save/manifest.json", "save/commit")


def main() -> None:
    fault, spec, marker, module, *args = sys.argv[1:]
    point, n = spec.rsplit(":", 1)
    n = int(n)
    assert point in POINTS, f"unknown point {point!r}; one of {POINTS}"
    assert fault == "kill" or (fault == "enospc" and point.startswith("save/")), (fault, point)
    seen = {"count": 0, "engine": None, "saves": 0, "stepping": False}

    def fire() -> None:
        """Append the marker line, then SIGKILL (`enospc`: the caller raises)."""
        engine = seen["engine"]
        with open(marker, "a") as f:
            f.write(json.dumps({"point": point, "n": n, "fault": fault,
                                "step": None if engine is None else engine.step}) + "\n")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def reached(name: str) -> None:
        """One visit to a counted point (load, forward, optimizer)."""
        if name == point:
            seen["count"] += 1
            if seen["count"] == n:
                fire()

    def in_save(name: str) -> bool:
        """Whether the save being written is the N-th and `name` the point: the fault is due."""
        return name == point and seen["saves"] == n

    def no_space() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_load, real_forward = Engine.load_checkpoint, Engine._forward
    real_engine_step = Engine.train_step
    real_train_step, real_write = RecipeWorker.train_step, ckpt._write_file
    real_save, real_commit = ckpt.CheckpointManager.save, storage.Store.commit
    real_write_data = dcp.FileSystemWriter.write_data

    def load_checkpoint(self):                  # every run resumes (or starts) through here
        seen["engine"] = self
        return real_load(self)

    def counted(batches):
        for batch in batches:
            reached("load")
            yield batch

    def train_step(self):                       # the training stream only, not eval passes
        if self._batches is None:
            self._batches = counted(iter(self.loader))
        return real_train_step(self)

    def forward(self, batch):
        out = real_forward(self, batch)
        reached("forward")
        return out

    def optimizer_step(optimizer, args, kwargs):
        # not DCP's own optimizer.step() on zero gradients that creates the state to load into
        if seen["stepping"]:
            reached("optimizer")

    def engine_step(self, *a, **kw):
        seen["stepping"] = True
        try:
            return real_engine_step(self, *a, **kw)
        finally:
            seen["stepping"] = False

    def save(self, *a, **kw):
        seen["saves"] += 1
        return real_save(self, *a, **kw)

    def write_data(self, plan, planner):
        # within DCP, so a raised error reaches the caller as DCP wraps it
        done = real_write_data(self, plan, planner)
        if in_save("save/dcp"):
            done.wait()
            shard = sorted(Path(str(self.path)).glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            fire()
            raise no_space()
        return done

    def write(store, path, data):
        name = "save/" + path.rsplit("/", 1)[-1]
        if in_save(name):
            real_write(store, path, data[: len(data) // 2])
            fire()
            raise no_space()
        real_write(store, path, data)

    def commit(self, work, final, nonce):
        if in_save("save/commit"):
            fire()
            raise no_space()
        real_commit(self, work, final, nonce)

    Engine.load_checkpoint, Engine._forward = load_checkpoint, forward
    Engine.train_step = engine_step
    RecipeWorker.train_step = train_step
    ckpt.CheckpointManager.save, ckpt._write_file, storage.Store.commit = save, write, commit
    dcp.FileSystemWriter.write_data = write_data
    register_optimizer_step_post_hook(optimizer_step)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
