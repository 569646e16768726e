"""The promotion gate: does a newly trained model replace the one in production?

A retraining run evaluates its candidate and the currently promoted model on the same held-out
suite, then asks `decide`: promote only when the configured metric is better by at least
`margin` (in the metric's own units, in the direction the metric improves). Every outcome comes
with a one-line reason that the flow stores as an artifact and shows on its card, so a refused
promotion says exactly why ("accuracy 0.412 vs promoted 0.430: worse by 0.018, needs +0.010").

Nothing here touches Metaflow: `flows/retrain_flow.py` finds the promoted run (the newest run
tagged `promoted`), calls `decide`, and moves the tag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Decision", "GateConfig", "decide"]


@dataclass(frozen=True)
class GateConfig:
    """metric: a key of the evaluation metrics; mode: whether larger or smaller is better;
    margin: how much better (>= 0) the candidate must be; missing_baseline: what to do when
    nothing is promoted yet."""

    metric: str = "accuracy"
    mode: Literal["max", "min"] = "max"
    margin: float = 0.0
    missing_baseline: Literal["promote", "refuse"] = "promote"

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"gate.mode must be 'max' or 'min', got {self.mode!r}")
        if not (self.margin >= 0 and math.isfinite(self.margin)):
            raise ValueError(f"gate.margin must be a finite number >= 0, got {self.margin}")


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate: float | None
    baseline: float | None
    improvement: float | None      # candidate - baseline, signed so that > 0 is better


def decide(gate: GateConfig, candidate: dict[str, float],
           baseline: dict[str, float] | None) -> Decision:
    """Promote `candidate` over `baseline` (None: nothing promoted yet) per `gate`."""
    name = gate.metric
    if name not in candidate:
        raise KeyError(f"gate.metric {name!r} is not among the candidate's metrics "
                       f"{sorted(candidate)}")
    value = float(candidate[name])
    if not math.isfinite(value):
        return Decision(False, f"{name} of the candidate is {value}: not promoted", value,
                        None, None)
    if baseline is None:
        promote = gate.missing_baseline == "promote"
        return Decision(promote, f"no promoted model yet; {name} {value:.4g}: "
                        f"{'promoted' if promote else 'not promoted (missing_baseline: refuse)'}",
                        value, None, None)
    if name not in baseline:
        raise KeyError(f"gate.metric {name!r} is not among the promoted model's metrics "
                       f"{sorted(baseline)}")
    base = float(baseline[name])
    improvement = (value - base) if gate.mode == "max" else (base - value)
    promote = improvement >= gate.margin and improvement > 0
    verdict = "better" if improvement > 0 else "worse" if improvement < 0 else "equal"
    reason = (f"{name} {value:.4g} vs promoted {base:.4g}: {verdict} by {abs(improvement):.4g}"
              f"{'' if gate.mode == 'max' else ' (lower is better)'}, needs "
              f"{'+' if gate.margin else '> '}{gate.margin:.4g}: "
              f"{'promoted' if promote else 'not promoted'}")
    return Decision(promote, reason, value, base, improvement)
