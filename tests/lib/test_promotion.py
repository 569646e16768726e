"""The promotion gate: a better model (by the margin) is promoted, a worse or not-better-enough
one is refused, and every decision says why."""

from __future__ import annotations

import math

import pytest

from posttrain.promotion import GateConfig, decide


def test_better_by_the_margin_is_promoted():
    d = decide(GateConfig(metric="accuracy", margin=0.01), {"accuracy": 0.45},
               {"accuracy": 0.43})
    assert d.promote and d.improvement == pytest.approx(0.02)
    assert d.reason == "accuracy 0.45 vs promoted 0.43: better by 0.02, needs +0.01: promoted"


@pytest.mark.parametrize("cand, margin, why", [
    (0.42, 0.0, "worse by 0.01"),
    (0.43, 0.0, "equal by 0"),
    (0.435, 0.01, "better by 0.005, needs +0.01: not promoted"),
])
def test_worse_equal_or_not_better_enough_is_refused(cand, margin, why):
    d = decide(GateConfig(metric="accuracy", margin=margin), {"accuracy": cand},
               {"accuracy": 0.43})
    assert not d.promote and why in d.reason and d.reason.endswith("not promoted")


def test_lower_is_better_metrics():
    gate = GateConfig(metric="loss", mode="min", margin=0.05)
    assert decide(gate, {"loss": 1.0}, {"loss": 1.1}).promote
    refused = decide(gate, {"loss": 1.08}, {"loss": 1.1})
    assert not refused.promote and "(lower is better)" in refused.reason


def test_first_model_and_bad_values():
    assert decide(GateConfig(), {"accuracy": 0.1}, None).promote
    assert not decide(GateConfig(missing_baseline="refuse"), {"accuracy": 0.1}, None).promote
    assert not decide(GateConfig(), {"accuracy": math.nan}, {"accuracy": 0.1}).promote
    with pytest.raises(KeyError, match="'accuracy' is not among the candidate's metrics"):
        decide(GateConfig(), {"loss": 1.0}, None)
    with pytest.raises(ValueError, match="margin"):
        GateConfig(margin=-1)
