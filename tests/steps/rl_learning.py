"""The learning-effect measure every RL algorithm's test uses on the bundled arithmetic task.

An RL objective maximizes the expected reward of a sample at the training temperature, so that
is what is measured: each of the 200 held-out problems' accuracy over EVAL_SAMPLES completions
at the training temperature, before (the SFT start) and after training, and the paired t
statistic of the 200 per-problem differences (`accuracy_gain`). The run's own held-out
evaluation records both (``baseline_records``, ``eval_records``).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SFT_MODEL = ROOT / "tests" / "fixtures" / "arithmetic_sft"
EVAL_SAMPLES = 32            # completions per held-out problem for the sampled accuracy
EVAL_OVERRIDES = {"eval.temperature": 1.0, "eval.samples_per_prompt": EVAL_SAMPLES,
                  "eval.num_records": 200}


def write_config(base: str | Path, out: Path, **changes) -> Path:
    """A bundled config starting from the committed SFT checkpoint, with dotted `changes`."""
    cfg = yaml.safe_load((ROOT / base).read_text())
    cfg["model"]["hf_dir"] = str(SFT_MODEL)
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    out.write_text(yaml.safe_dump(cfg))
    return out


def mean_and_t(diffs: list[float]) -> tuple[float, float]:
    """The mean of paired differences and its t statistic (mean over its standard error)."""
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return mean, mean / (sd / math.sqrt(n)) if sd > 0 else math.inf


def accuracy_gain(result: dict) -> tuple[float, float, float, float]:
    """(accuracy before, after, mean per-problem gain, paired t) of a run's held-out records."""
    before, after = result["baseline_eval"], result["eval"]
    assert before["eval/num_prompts"] == after["eval/num_prompts"] == 200
    assert before["eval/samples_per_prompt"] == after["eval/samples_per_prompt"] == EVAL_SAMPLES
    was = {r["prompt"]: r["accuracy"] for r in result["baseline_records"]}
    now = {r["prompt"]: r["accuracy"] for r in result["eval_records"]}
    assert len(was) == len(now) == 200 and was.keys() == now.keys()
    gain, t = mean_and_t([now[p] - was[p] for p in now])
    assert abs(gain - (after["eval/accuracy"] - before["eval/accuracy"])) < 1e-9
    return before["eval/accuracy"], after["eval/accuracy"], gain, t
