"""Run a training step's CLI and SIGKILL it at a point inside the save of one checkpoint.

    python tests/steps/kill_in_save.py STEP POINT MODULE [CLI arguments...]

POINT is where the process dies while checkpoint STEP is written:
  dcp              DCP has written the model and optimizer shard, which is then cut to half
                   its size (a torn shard), before anything else;
  rank-00000.json, meta.json, manifest.json
                   half of that file is written;
  commit           every file is written and hashed, the directory not yet renamed into place.
Nothing in the library knows about this: the hooks are patched in here, in the child process.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))       # `steps` from the checkout

import torch.distributed.checkpoint as dcp  # noqa: E402

from posttrain.train import checkpoint as ckpt  # noqa: E402
from posttrain.train import checkpoint_storage as storage  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    step, point, module, *args = sys.argv[1:]
    target = f"step-{int(step):08d}"
    real_write, real_save, real_commit = ckpt._write_file, dcp.save, storage.Store.commit

    def write(store, path, data):
        if target in path and path.endswith("/" + point):
            real_write(store, path, data[: len(data) // 2])
            die()
        real_write(store, path, data)

    def save(state, *, storage_writer, **kwargs):
        out = real_save(state, storage_writer=storage_writer, **kwargs)
        where = Path(str(storage_writer.path))
        if point == "dcp" and target in str(where):
            shard = sorted(where.glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            die()
        return out

    def commit(self, work, final, nonce):
        if point == "commit" and target in final:
            die()
        real_commit(self, work, final, nonce)

    ckpt._write_file, dcp.save, storage.Store.commit = write, save, commit
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
