"""GRPO against a reward model that the reward recipe trained in this same session.

One module fixture trains the bundled tiny reward model (`configs/reward/tiny.yaml`, one inline
worker, RM_STEPS steps: Bradley-Terry on the bundled preference pairs), then runs the bundled
`configs/grpo/rm_tiny.yaml` (the committed arithmetic SFT checkpoint, `reward_model` weight 1 +
`format` 0.1, exact match logged with weight 0) for GRPO_STEPS steps against that export, as
users run them. What is proved:
- the RM score GRPO optimizes rises: the mean of the last WINDOW steps' batch means exceeds the
  first WINDOW steps' (Welch t over the per-step means), and on 64 held-out prompts the greedy
  completion's RM score rises per prompt (paired t);
- the reward model is scored in the controller's process and closed with the run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from steps import train_grpo, train_reward

from .rl_learning import SFT_MODEL, mean_and_t

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains a reward model and a policy

RM_STEPS = 12
GRPO_STEPS = 20
WINDOW = 8                   # steps at each end of the run whose RM scores are compared
MIN_TRAIN_GAIN = 0.3         # RM score, last WINDOW steps' mean minus the first's
MIN_TRAIN_T = 2.0            # Welch t of those per-step means
MIN_HELDOUT_GAIN = 0.5       # greedy RM score on held-out prompts, mean per-prompt gain
MIN_HELDOUT_T = 4.0          # paired t over the 64 prompts


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("grpo_rm")
    rm = yaml.safe_load((ROOT / "configs/reward/tiny.yaml").read_text())
    rm["run"] = {"dir": str(tmp / "reward"), "num_workers": 1, "launcher": "inline"}
    rm["train"].update({"max_steps": RM_STEPS, "checkpoint_every_steps": RM_STEPS})
    rm["eval"] = {"max_batches": 10}
    (tmp / "reward.yaml").write_text(yaml.safe_dump(rm))
    reward = train_reward.run(tmp / "reward.yaml", show_progress=False)
    grpo = yaml.safe_load((ROOT / "configs/grpo/rm_tiny.yaml").read_text())
    grpo["model"]["hf_dir"] = str(SFT_MODEL)
    grpo["run"]["dir"] = str(tmp / "grpo")
    grpo["train"].update({"max_steps": GRPO_STEPS, "checkpoint_every_steps": GRPO_STEPS})
    grpo["rewards"]["functions"][0]["params"]["dir"] = reward["hf_dir"]
    grpo["eval"]["num_records"] = grpo["eval"]["max_prompts"]
    (tmp / "grpo.yaml").write_text(yaml.safe_dump(grpo))
    result = train_grpo.run(tmp / "grpo.yaml", show_progress=False)
    steps = [json.loads(x) for x in (tmp / "grpo" / "metrics.jsonl").read_text().splitlines()]
    return {"reward": reward, "grpo": result,
            "train": [m for m in steps if "reward/reward_model/mean" in m]}


def test_the_reward_model_learned_its_pairs(runs):
    ev = runs["reward"]["eval"]
    print(f"reward model after {RM_STEPS} steps: held-out accuracy {ev['eval_accuracy']:.3f}")
    assert ev["eval_accuracy"] > 0.6


def test_grpo_raises_the_reward_model_score(runs):
    """The RM score of the sampled batches, first WINDOW steps against the last WINDOW, and
    of each held-out prompt's greedy completion before and after. Measured on AMD EPYC over
    ATEN_CPU_CAPABILITY default / avx2 / native, GRPO seeds 0 and 1, and reward models of 12
    and 20 steps (each variant's own): train +0.76 to +1.24 (Welch t 3.8 to 4.7), held-out
    +1.39 to +2.10 (paired t 9.2 to 15.8). The per-step batch means are noisy (8 prompts a
    step), hence the low bar on that t; the paired held-out statistic carries the test.

    Exact match falls meanwhile (0.52 -> 0.00-0.02 greedy held-out in every variant): the tiny
    reward model scores surface features of its pairs, not arithmetic, and the policy finds
    them (reward over-optimization, Gao et al., 2022). Only the RM score is asserted."""
    train = [m["reward/reward_model/mean"] for m in runs["train"]]
    assert len(train) == GRPO_STEPS
    assert all(m["reward/reward_model/failures"] == 0 for m in runs["train"])
    first, last = train[:WINDOW], train[-WINDOW:]
    gain = sum(last) / WINDOW - sum(first) / WINDOW
    spread = math.sqrt(_var(first) / WINDOW + _var(last) / WINDOW)
    result = runs["grpo"]
    before = {r["prompt"]: r["reward_model"] for r in result["baseline_records"]}
    after = {r["prompt"]: r["reward_model"] for r in result["eval_records"]}
    assert len(before) == len(after) == 64 and before.keys() == after.keys()
    heldout, t = mean_and_t([after[p] - before[p] for p in after])
    print(f"RM score: train {sum(first) / WINDOW:.3f} -> {sum(last) / WINDOW:.3f} (Welch t "
          f"{gain / spread:.1f}); held-out greedy +{heldout:.3f} (paired t {t:.1f}); exact "
          f"match {result['baseline_eval']['eval/accuracy']:.3f} -> "
          f"{result['eval']['eval/accuracy']:.3f}")
    assert gain > MIN_TRAIN_GAIN and gain / spread > MIN_TRAIN_T
    assert heldout > MIN_HELDOUT_GAIN and t > MIN_HELDOUT_T


def _var(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
