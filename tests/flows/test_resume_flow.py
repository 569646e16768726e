"""`python flows/<sft|grpo>_flow.py resume` after the whole run was killed mid-training.

The run's process group (the Metaflow runtime, its train task and the task's Ray cluster) is
SIGKILLed once the train step has committed checkpoint 2 (SFT: of 6 optimizer steps; GRPO:
of 4 GRPO steps), so the run fails without its @retry. `resume` then clones the steps before
it (their artifacts are reused, prepare does not run again), reruns the train step, which
continues from the failed run's checkpoint 2 in the same storage root, and exports weights
byte-identical to an uninterrupted run's; the lineage of the resumed run names its origin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from .conftest import GRPO_FLOW, REPO, SFT_FLOW, TINY_GRPO, TINY_SFT, ray_processes_under

pytestmark = pytest.mark.slow


@dataclass
class Case:
    flow_file: Path
    flow: str                 # the flow class
    train_step: str           # the step that trains (and checkpoints)
    base: Path                # its config
    changes: dict
    steps: int


CASES = {
    "sft": Case(SFT_FLOW, "SFTFlow", "train", TINY_SFT, {
        "train.max_steps": 6, "train.checkpoint_every_steps": 2, "eval.max_batches": 2,
        "eval.generate": {"num_samples": 1, "max_new_tokens": 4}}, 6),
    "grpo": Case(GRPO_FLOW, "GRPOFlow", "grpo", TINY_GRPO, {
        "model.hf_dir": str(REPO / "tests/fixtures/arithmetic_sft"),
        "train.max_steps": 4, "train.checkpoint_every_steps": 2, "train.prompts_per_step": 4,
        "train.samples_per_prompt": 4, "train.mini_batches": 1, "eval.max_prompts": 4, "eval.num_records": 2}, 4),
}


def _flow(sandbox, case: Case, config: Path, *args: str) -> subprocess.Popen:
    """The flow's command line in its own process group, logging to the sandbox."""
    with open(sandbox.root / "flow.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, str(case.flow_file), "--no-pylint", "--config", "config",
             str(config), *args], cwd=REPO, env={**os.environ, **sandbox.env}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)


def _checkpoints(sandbox, case: Case, step: int) -> list[Path]:
    return list((sandbox.root / "runs" / case.flow).glob(
        f"*/{case.train_step}/checkpoints/step-{step:08d}"))


def _kill_group_after_checkpoint(proc: subprocess.Popen, sandbox, case: Case, step: int,
                                 other_run: str, timeout_s: float = 400) -> None:
    """SIGKILL the flow's whole process group once its train checkpoint `step` is committed
    (`other_run`'s does not count)."""
    deadline = time.monotonic() + timeout_s
    while not any((p / "manifest.json").is_file() for p in _checkpoints(sandbox, case, step)
                  if p.parts[-4] != other_run):
        assert proc.poll() is None, f"the run ended before checkpoint {step}: see flow.log"
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout_s} s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _kill_strays(path: str) -> None:
    """Ray daemons of the killed task (their own session; not in the process group)."""
    for line in ray_processes_under(path):
        try:
            psutil.Process(int(line.split(":")[0])).kill()
        except psutil.NoSuchProcess:
            pass


def _safetensors(hf_dir: str) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(Path(hf_dir).glob("*.safetensors"))}
    assert files, hf_dir
    return files


def _runner(sandbox, case: Case, config: Path | None):
    """The flow's Runner; `resume` takes no config (the origin run's is used)."""
    from metaflow import Runner
    configs = {"config": [("config", str(config))]} if config else {}
    return Runner(str(case.flow_file), cwd=str(REPO), env=sandbox.env, show_output=False,
                  pylint=False, **configs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_continues_a_killed_run_from_its_checkpoint(sandbox, monkeypatch, name):
    from metaflow import Run
    case = CASES[name]
    monkeypatch.setenv("USER", sandbox.env["USER"])
    config = sandbox.config(case.base, **case.changes)
    with _runner(sandbox, case, config) as runner:              # uninterrupted
        reference = runner.run().run
    assert reference.successful

    killed = _flow(sandbox, case, config, "run")
    _kill_group_after_checkpoint(killed, sandbox, case, 2, reference.id)
    _kill_strays(sandbox.ray_tmpdir)
    origin_id = [p.parts[-4] for p in _checkpoints(sandbox, case, 2)
                 if p.parts[-4] != reference.id][0]
    origin = Run(f"{case.flow}/{origin_id}", _namespace_check=False,
                 _current_metadata=f"local@{sandbox.root / 'mfroot'}")
    assert not origin.successful

    with _runner(sandbox, case, None) as runner:
        executing = runner.resume()
        resumed, out = executing.run, executing.stdout
    assert resumed.successful and resumed.id not in (origin.id, reference.id), out[-3000:]
    # start and prepare were cloned from the origin: its storage root and prepared data
    start, prepare = resumed["start"].task, resumed["prepare"].task
    assert start.data.storage_root == origin["start"].task.data.storage_root
    assert prepare.data.prepared_uri == origin["prepare"].task.data.prepared_uri
    assert prepare.data.content_hash == reference["prepare"].task.data.content_hash
    result = resumed["join"].task.data.train_result
    assert (result["started_at_step"], result["steps"]) == (2, case.steps)
    assert _safetensors(resumed["join"].task.data.hf_uri) == \
        _safetensors(reference["join"].task.data.hf_uri)
    assert resumed["end"].task.data.lineage["resumed_from"] == origin.pathspec
    assert not ray_processes_under(sandbox.ray_tmpdir)
