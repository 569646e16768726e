"""What a training report shows, as data: Vega-Lite chart specs and table rows.

No plotting library and no Metaflow here: the functions turn the metrics JSONL of a run
(`posttrain.train.metrics.MetricsWriter`) and an evaluation result into plain dicts and lists.
A Metaflow card wraps them in `VegaChart`/`Table`; a notebook can hand the same specs to
Altair or any Vega renderer.
"""

from __future__ import annotations

import math
from typing import Any

# (metrics key, axis title) of the curves a training report plots over optimizer steps.
TRAIN_CURVES: tuple[tuple[str, str], ...] = (
    ("loss", "train loss"),
    ("real_tokens_per_s", "real tokens/s (padding excluded)"),
    ("mfu", "MFU (model FLOPs / peak)"),
)


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training records (evaluation records carry no `loss`), last one per step.

    A resumed run appends steps it had already logged before the crash; the later record of a
    step wins, so each step appears once and the curve is continuous.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if "step" in r and "loss" in r:
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


def line_chart(records: list[dict[str, Any]], key: str, title: str) -> dict[str, Any]:
    """A Vega-Lite line chart of `key` over `step`."""
    values = [{"step": int(r["step"]), key: float(r[key])} for r in records
              if key in r and r[key] is not None and math.isfinite(float(r[key]))]
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": title,
        "width": 480,
        "height": 200,
        "data": {"values": values},
        "mark": {"type": "line", "point": len(values) <= 50},
        "encoding": {
            "x": {"field": "step", "type": "quantitative", "title": "optimizer step"},
            "y": {"field": key, "type": "quantitative", "title": title,
                  **({"axis": {"format": ".1%"}} if key == "mfu" else {})},
        },
    }


def training_charts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Loss, throughput and MFU over steps, from the raw metrics records."""
    steps = step_records(records)
    return [line_chart(steps, key, title) for key, title in TRAIN_CURVES]


def training_summary(records: list[dict[str, Any]]) -> list[list[Any]]:
    """[[name, value]] rows: steps, final loss, mean tokens/s and MFU, peak memory."""
    steps = step_records(records)
    if not steps:
        return [["steps", 0]]
    mean = lambda key: sum(float(r[key]) for r in steps) / len(steps)  # noqa: E731
    rows = [["steps logged", len(steps)],
            ["last step", int(steps[-1]["step"])],
            ["final train loss", round(float(steps[-1]["loss"]), 4)],
            ["mean real tokens/s", round(mean("real_tokens_per_s"), 1)],
            ["mean MFU", f"{mean('mfu'):.2%}"]]
    if "peak_memory_bytes" in steps[-1]:
        rows.append(["peak memory (GiB)",
                     round(max(int(r["peak_memory_bytes"]) for r in steps) / 2**30, 3)])
    return rows


# (metrics key, axis title) of a GRPO run's curves over GRPO steps.
GRPO_CURVES: tuple[tuple[str, str], ...] = (
    ("reward/total/mean", "train reward (mean over rollouts)"),
    ("eval/accuracy", "held-out accuracy (greedy)"),
    ("kl", "KL to the reference (k3)"),
    ("entropy", "policy entropy (response tokens)"),
    ("response_length/mean", "response length (tokens)"),
    ("rollout_tokens_per_s", "rollout tokens/s"),
    ("mfu", "update MFU (model FLOPs / peak)"),
    ("sync/max_abs_logprob_diff", "weight sync check: max |engine - trainer| log-prob"),
)
GRPO_PHASES = ("time/generate_s", "time/score_s", "time/logprobs_s", "time/update_s",
               "time/sync_s")


def grpo_charts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reward, held-out accuracy, KL, entropy, lengths, throughput, sync check, phase times."""
    charts = []
    for key, title in GRPO_CURVES:
        with_key = [r for r in records if key in r]
        if with_key:
            charts.append(line_chart(with_key, key, title))
    phases = [{"step": int(r["step"]), "phase": k.split("/")[1][:-2], "seconds": float(r[k])}
              for r in records for k in GRPO_PHASES if k in r]
    if phases:
        charts.append({
            "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
            "title": "time per GRPO step, by phase (s)", "width": 480, "height": 200,
            "data": {"values": phases}, "mark": "bar",
            "encoding": {"x": {"field": "step", "type": "ordinal", "title": "GRPO step"},
                         "y": {"field": "seconds", "type": "quantitative", "stack": True},
                         "color": {"field": "phase", "type": "nominal"}}})
    return charts


def grpo_summary(records: list[dict[str, Any]]) -> list[list[Any]]:
    """[[name, value]] rows of a GRPO run: steps, rewards, accuracy at the start and the end."""
    steps = [r for r in records if "reward/total/mean" in r]
    evals = [r for r in records if "eval/accuracy" in r or "eval/reward_mean" in r]
    rows: list[list[Any]] = [["GRPO steps logged", len(steps)]]
    if steps:
        last = steps[-min(5, len(steps)):]
        rows.append(["train reward, last 5 steps",
                     round(sum(r["reward/total/mean"] for r in last) / len(last), 4)])
        rows.append(["mean rollout tokens/s",
                     round(sum(r["rollout_tokens_per_s"] for r in steps) / len(steps), 1)])
        rows.append(["max weight-sync |diff|",
                     f"{max(r['sync/max_abs_logprob_diff'] for r in steps):.2e}"])
        if all("mfu" in r for r in steps):
            rows.append(["mean update MFU", f"{sum(r['mfu'] for r in steps) / len(steps):.2%}"])
        if all("peak_memory_bytes" in r for r in steps):
            rows.append(["peak memory (GiB)",
                         round(max(int(r["peak_memory_bytes"]) for r in steps) / 2**30, 3)])
    for r in (evals[:1] + evals[-1:]) if len(evals) > 1 else evals:
        for key in ("eval/accuracy", "eval/reward_mean"):
            if key in r:
                rows.append([f"held-out {key.split('/')[1]} at step {int(r['step'])}",
                             round(float(r[key]), 4)])
    return rows


def comparison_chart(table: list[dict[str, Any]], title: str = "model vs baseline, per metric"
                     ) -> dict[str, Any]:
    """Bars of the model and the baseline side by side, one small panel per (task, metric),
    each with its own y scale (a loss, a perplexity and an accuracy do not share one).

    `table` holds the rows of `posttrain.eval.suites.SuiteResult.table`: task, metric, model,
    baseline, delta.
    """
    values = [{"metric": f"{r['task']} / {r['metric']}", "checkpoint": which,
               "value": float(r[which])}
              for r in table for which in ("baseline", "model")
              if r[which] is not None and math.isfinite(float(r[which]))]
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": title,
        "data": {"values": values},
        "facet": {"field": "metric", "type": "nominal", "title": None,
                  "sort": list(dict.fromkeys(v["metric"] for v in values))},
        "columns": 4,
        "spec": {
            "width": 110, "height": 110,
            "mark": "bar",
            "encoding": {
                "x": {"field": "checkpoint", "type": "nominal", "title": None,
                      "sort": ["baseline", "model"]},
                "y": {"field": "value", "type": "quantitative", "title": None},
                "color": {"field": "checkpoint", "type": "nominal",
                          "sort": ["baseline", "model"]},
                "tooltip": [{"field": "metric"}, {"field": "checkpoint"},
                            {"field": "value", "format": ".4g"}],
            },
        },
        "resolve": {"scale": {"y": "independent"}},
    }


def comparison_rows(table: list[dict[str, Any]], digits: int = 4) -> list[list[Any]]:
    """[[task, metric, model, baseline, delta]] with values rounded for display."""
    def fmt(x: Any) -> Any:
        return round(float(x), digits) if isinstance(x, (int, float)) else x
    return [[r["task"], r["metric"], fmt(r["model"]), fmt(r["baseline"]), fmt(r["delta"])]
            for r in table]


def record_rows(records: list[dict[str, Any]], limit: int = 8, max_chars: int = 160
                ) -> tuple[list[str], list[list[Any]]]:
    """(headers, rows) of the first `limit` per-sample records, long texts cut to `max_chars`."""
    shown = records[:limit]
    headers = list(dict.fromkeys(k for r in shown for k in r))

    def cell(x: Any) -> Any:
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, str) and len(x) > max_chars:
            return x[:max_chars] + "…"
        return x
    return headers, [[cell(r.get(k, "")) for k in headers] for r in shown]
