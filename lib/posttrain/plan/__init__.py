"""The memory plan of a run before launch: per-rank bytes by part, the predicted peak, tokens
and FLOPs per step (`posttrain plan --config ...`), and the start-of-run check that it fits.

`memory.plan_run(cfg, gpu=...)` makes the plan (`memory` has the model of each part, `trace`
the meta-device and fake-tensor measurements it rests on); `check.check_run(cfg)` compares
it with the declared devices (`devices`).

The names below are imported on first use: the plan needs torch, while `devices` (the GPU
table a config's ``run.gpu`` is checked against) is read without it."""

import importlib

__all__ = ["MemoryPlan", "PlanError", "RankPlan", "check_fits", "check_run", "host_budget",
           "plan_run"]

_HOMES = {"PlanError": "check", "check_fits": "check", "check_run": "check",
          "host_budget": "check",
          "MemoryPlan": "memory", "RankPlan": "memory", "plan_run": "memory"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
