"""Asynchronous GRPO (`rollout.max_staleness: 1`) end to end: a Ray trainer rank and a separate
engine actor, started by the CLI as a user starts it, on the policy where a batch made ahead
carries the most state: the bundled configs/grpo/moe_replay_tiny.yaml (a tiny random
Qwen3-MoE with MoE routing replay), 4 steps of 4 prompts x 4 samples x 16 new tokens.

- the engine generates the batch of step s+1 while the trainer updates on step s: step 1 trains
  on samples of the weights it holds (staleness 0, engine and trainer log-probs equal), every
  later step on samples of the policy one update older (staleness 1: the trainer's log-probs
  of them differ from the engine's, and the importance weights correct for it); one update
  behind, the engine chose experts the trainer would not, and replay overrides them
  (`routing/mismatch_rate` > 0);
- SIGKILL right after a checkpoint, and again in the middle of a step (while the trainer
  updates and the engine generates the next batch), then a restart: the exported weights and
  every step's metrics (the mismatch rate of the replayed batches included) equal those of a
  run that never stopped. The batch made ahead is in the checkpoint with its routing records,
  so it is neither lost (regenerated with newer weights) nor sampled twice; had the records
  been lost, that batch would route itself (no mismatch rate, other losses).

The same mechanisms on a dense policy are the same code minus the routing records; the
synchronous replay run (golden losses) is tests/steps/test_train_grpo_replay.py.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from .conftest import run_and_kill, run_to_end, safetensors
from .test_train_grpo import metrics
from .test_train_grpo_replay import small_config

STEPS = 4
pytestmark = pytest.mark.slow
_run_to_end = partial(run_to_end, "steps.train_grpo", launcher="ray")
_run_and_kill = partial(run_and_kill, "steps.train_grpo", launcher="ray")


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory) -> tuple[Path, Path]:
    workdir = tmp_path_factory.mktemp("grpo_async")
    config = small_config(workdir, "async", keep_eval=True, **{
        "run.launcher": "ray", "run.resources_per_worker": {"CPU": 1},
        "rollout.placement": "separate", "rollout.num_engines": 1,
        "rollout.resources_per_engine": {"num_cpus": 1}, "rollout.max_staleness": 1,
        "train.max_steps": STEPS, "train.mini_batches": 1,
        "train.checkpoint_every_steps": 1, "train.keep_checkpoints": 10,
        "eval.max_prompts": 8})
    ref = workdir / "reference"
    _run_to_end(config, ref)
    return config, ref


def test_batches_are_one_policy_version_stale_and_importance_corrected(async_reference):
    _, ref = async_reference
    steps = [m for m in metrics(ref) if "loss" in m]
    assert [m["rollout/staleness"] for m in steps] == [0.0] + [1.0] * (STEPS - 1)
    assert [m["rollout/policy_version"] for m in steps] == [0.0] + list(range(STEPS - 1))
    # step 1: the engine's weights are the trainer's; later, the trainer is one update ahead
    assert steps[0]["logprob_gap"] < 1e-5
    assert all(m["logprob_gap"] > 1e-4 for m in steps[1:]), [m["logprob_gap"] for m in steps]
    assert all(m["is_weight_mean"] != 1.0 for m in steps[1:])
    # after every sync the engine holds exactly the trainer's weights
    assert max(m["sync/max_abs_logprob_diff"] for m in steps) <= 1e-5
    # one update behind, the engine chose experts the trainer would not: replay overrides them
    assert all(m["routing/mismatch_rate"] > 0 for m in steps[1:]), steps
    result = json.loads((ref / "result.json").read_text())
    assert result["steps"] == STEPS and result["eval"]["eval/num_prompts"] == 8


def test_sigkill_and_restart_gives_bit_identical_weights(async_reference, tmp_path):
    """Killed right after checkpoint 1 is committed (between steps); restarted and killed
    again halfway through the reference run's update of step 3, while the engine generates
    batch 4 (a kill that lands later, after checkpoint 3, is rolled back to checkpoint 2 by
    `run_and_kill`, so it still tests a restart from 2); restarted to the end."""
    config, ref = async_reference
    killed = tmp_path / "killed"
    third = [m for m in metrics(ref) if "loss" in m][2]
    _run_and_kill(config, killed, 1)
    # checkpoint 1 holds the batch of step 2, made ahead, with its routing records
    ahead = json.loads((killed / "checkpoints" / "step-00000001" / "meta.json").read_text())
    batches = ahead["extra"]["controller"]["rollouts_ahead"]
    assert [b["step"] for b in batches] == [1]
    assert all(e["routing"]["shape"][1:] == [3, 2]       # 3 MoE layers x top-2
               for g in batches[0]["batch"]["groups"] for e in g)
    _run_and_kill(config, killed, 2,
                  delay_s=third["time/rollout_wait_s"] + third["time/update_s"] / 2)
    _run_to_end(config, killed)
    result = json.loads((killed / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (2, STEPS)
    assert safetensors(killed / "hf") == safetensors(ref / "hf")
    keys = ("reward/total/mean", "loss", "grad_norm", "rollout_tokens", "logprob_gap",
            "rollout/staleness", "rollout/policy_version", "routing/mismatch_rate")
    want = {m["step"]: m for m in metrics(ref) if "loss" in m}
    got = {m["step"]: m for m in metrics(killed) if "loss" in m}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step
