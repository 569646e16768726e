"""The memory plan of a run before launch: per-rank bytes by part, the predicted peak, tokens
and FLOPs per step (`posttrain plan --config ...`), and the start-of-run check that it fits.

`memory.plan_run(cfg, gpu=...)` makes the plan (`memory` has the model of each part, `trace`
the meta-device and fake-tensor measurements it rests on); `check.check_run(cfg)` compares
it with the declared devices (`devices`)."""

from posttrain.plan.check import PlanError, check_fits, check_run
from posttrain.plan.memory import MemoryPlan, RankPlan, plan_run

__all__ = ["MemoryPlan", "PlanError", "RankPlan", "check_fits", "check_run", "plan_run"]
