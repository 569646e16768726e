"""SFT with the data read as streams (`train.loader.streams: 2`): each rank reads only its
streams, and a run is still the same run on 1 or 2 workers, across a SIGKILL, and across a
resume on another number of workers.

Against one uninterrupted reference run (a subprocess, 1 inline worker that reads both
streams, a checkpoint after every step):
- SIGKILL + restart on the same worker count gives bit-identical weights and losses;
- the 1-worker checkpoint resumed on 2 Ray workers, each reading one stream, continues with
  exactly the same global micro-batches (same real and loss tokens per step; the checkpoint
  holds every stream's position, so each rank restores its own), losses and weights within
  1e-5. (That 1 and 2 ranks deal out the same batches from a fresh start is shown on the
  loader in tests/lib/data/test_stream_loader.py.)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import yaml

from steps import train_sft

from .conftest import assert_weights_close, run_and_kill, run_to_end, safetensors
from .test_train_sft import CONFIG as SFT_CONFIG

_run_to_end = partial(run_to_end, "steps.train_sft")
_run_and_kill = partial(run_and_kill, "steps.train_sft")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MAX_STEPS, KILL_STEP = 8, 3
LOSS_ATOL = WEIGHT_ATOL = 1e-5

# the SFT recipe tests' tiny run, with the data read as 2 streams and 8 steps
CONFIG = json.loads(json.dumps(SFT_CONFIG))
CONFIG["train"].update(max_steps=MAX_STEPS, scheduler={"kind": "constant"})
CONFIG["train"]["loader"]["streams"] = 2


@dataclass
class Run:
    tmp: Path
    config: Path
    ref_dir: Path

    @staticmethod
    def metrics(run_dir: Path) -> dict[int, dict]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("streams")
    for split, rows in (("train", 120), ("eval", 16)):
        lines = (ROOT / "assets" / "data" / "chat" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["train"] = [{"name": "chat", "path": str(tmp / "train.jsonl")}]
    cfg["data"]["eval"] = [{"name": "chat", "path": str(tmp / "eval.jsonl")}]
    config = tmp / "streams.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _run_to_end(config, tmp / "reference")
    return Run(tmp, config, tmp / "reference")


def _same_batches_and_losses(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for s in steps:
        assert (got[s]["real_tokens"], got[s]["loss_tokens"], got[s]["tokens_seen"]) == \
            (want[s]["real_tokens"], want[s]["loss_tokens"], want[s]["tokens_seen"]), s
        assert abs(got[s]["loss"] - want[s]["loss"]) <= LOSS_ATOL, (s, got[s], want[s])


def test_sigkill_and_restart_gives_bit_identical_weights(ref):
    run_dir = ref.tmp / "killed"
    _run_and_kill(ref.config, run_dir, KILL_STEP)
    _run_to_end(ref.config, run_dir)
    assert safetensors(run_dir / "hf") == safetensors(ref.ref_dir / "hf")
    got, want = Run.metrics(run_dir), Run.metrics(ref.ref_dir)
    assert [got[s]["loss"] for s in sorted(got)] == [want[s]["loss"] for s in sorted(want)]


def test_a_one_worker_checkpoint_resumes_on_two_workers(ref, local_ray):
    run_dir = ref.tmp / "resharded"
    name = f"step-{KILL_STEP:08d}"
    shutil.copytree(ref.ref_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
    result = train_sft.run(ref.config, overrides={
        "run.dir": str(run_dir), "run.launcher": "ray", "run.num_workers": 2},
        prepared_dir=str(ref.ref_dir / "prepared"), show_progress=False)
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, MAX_STEPS)
    _same_batches_and_losses(Run.metrics(run_dir), Run.metrics(ref.ref_dir),
                             range(KILL_STEP + 1, MAX_STEPS + 1))
    assert_weights_close(Path(result["hf_dir"]), ref.ref_dir / "hf", WEIGHT_ATOL)
