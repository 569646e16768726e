"""Experiment trackers: a run's metrics, config and lineage in MLflow and Weights & Biases.

`run.trackers` lists where a run's metrics go beside `metrics.jsonl`, TensorBoard and the
Metaflow cards (what TRL's ``report_to`` names, each tracker with its own settings)::

    run:
      trackers:
        - {kind: mlflow, tracking_uri: http://127.0.0.1:5000, experiment: sft}
        - {kind: wandb, project: my-project, mode: offline}

What a tracker receives, from the driver only (the one process that writes `metrics.jsonl`:
rank 0's view; the workers never talk to a tracker):

- every record of `metrics.jsonl` at its ``step``, its numbers only (text and lists stay in
  the file): each optimizer step's metrics, and the run's held-out evaluation at the last step
  (GRPO's baseline evaluation at step 0). A flow's evaluate step adds its suite's table to the
  same tracker runs (`log_evaluation`), at the last step, as ``suite/<task>/<metric>``
  (and ``suite_baseline/...``, ``suite_delta/...``).
- the resolved config: MLflow params (flattened, ``train.optimizer.lr``), W&B config (nested).
- the run's lineage (`run_lineage`): MLflow tags ``posttrain.recipe``, ``posttrain.config_hash``,
  ``posttrain.dataset_hash`` (the prepared data's content hash), ``posttrain.base_model``,
  ``posttrain.code`` (and ``mlflow.source.git.commit``), and in a flow ``metaflow.flow``,
  ``metaflow.run_id``, ``metaflow.step``, ``metaflow.task_id``, ``metaflow.pathspec``; in W&B
  the same under ``config.posttrain`` and as short tags (``config:<hash12>``,
  ``dataset:<hash12>``, ``metaflow:<Flow>/<run id>``, as the Metaflow run is tagged).

A key left unset is read as each tracker's own client reads it: ``tracking_uri`` from
MLFLOW_TRACKING_URI (else MLflow's default, ``sqlite:///mlflow.db``, which needs the full
``mlflow`` package), ``experiment`` from MLFLOW_EXPERIMENT_NAME (else MLflow's Default
experiment); ``project`` from WANDB_PROJECT (else ``posttrain``), ``entity`` from WANDB_ENTITY,
``mode`` from WANDB_MODE (else online), ``dir`` from WANDB_DIR (else the run directory),
``group`` from WANDB_RUN_GROUP, ``name`` from WANDB_NAME (W&B) — else the Metaflow pathspec,
else the run directory's name. Credentials stay in the environment (WANDB_API_KEY,
MLFLOW_TRACKING_TOKEN, ...), never in a config.

Resume. When the tracker runs start, their ids are written to ``trackers.json`` in the run's
checkpoint directory (beside ``checkpoints/``). A run that continues from a checkpoint
continues those runs: MLflow's run (status back to RUNNING), W&B's run id (``resume="allow"``;
offline, each attempt is a directory of its own under the same id, which ``wandb sync`` joins).
The steps after the checkpoint that the interrupted attempt had already logged are logged
again, as `metrics.jsonl` has them again: MLflow keeps both values at such a step (the same
numbers but the timings, since resume is bit-identical); W&B keeps the first, as it refuses
a step below the run's current one (online those are not even sent; offline, ``wandb sync``
replays the attempts' files in order into the one run: not tested here, there is no server).
W&B writes what it is given every 15 s, so a killed attempt loses its last records, also
ones before the checkpoint: the resumed run logs `metrics.jsonl`'s records up to the
checkpoint again to W&B, which fills that gap and keeps the rest as it was. A run that starts
at step 0 (no checkpoint) starts new tracker runs; an MLflow run a previous attempt left is
marked KILLED.

Failure policy. A tracker that cannot start (package not installed, server unreachable, not
logged in, the run to resume not found) stops the run before its first step with a
`TrackerError` naming the tracker and what to do. An error while logging is a warning and
training goes on; after `MAX_FAILURES` failures in a row the tracker is dropped for the rest of
the run (a warning says so): `metrics.jsonl` always has every step.

The two backends are `posttrain.train.tracker_backends`. Both packages are optional
(``pip install 'posttrain[trackers]'``) and imported only when configured; `mlflow-skinny` is
enough for a server or a local file store (MLflow 3 asks for MLFLOW_ALLOW_FILE_STORE=true to
use ``file:`` stores).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from posttrain.train.tracker_backends import (STATE_FILE, TrackerError, flatten, make_tracker,
                                              numbers)

__all__ = ["MAX_FAILURES", "STATE_FILE", "TrackerConfig", "TrackerError", "Trackers",
           "check_trackers", "flatten", "log_evaluation", "numbers", "open_trackers",
           "run_lineage", "suite_metrics"]

log = logging.getLogger(__name__)

MAX_FAILURES = 3                # logging errors in a row before a tracker is dropped


@dataclass(frozen=True)
class TrackerConfig:
    """One entry of ``run.trackers``; keys of the other kind must stay unset."""

    kind: Literal["mlflow", "wandb"]
    name: str | None = None             # the tracker run's name (module docstring: default)
    tags: dict[str, str] = field(default_factory=dict)   # beside the lineage tags
    tracking_uri: str | None = None     # mlflow: http://host:5000, file:/path, sqlite:///x.db
    experiment: str | None = None       # mlflow: experiment name (created when missing)
    project: str | None = None          # wandb
    entity: str | None = None           # wandb: team or user
    mode: Literal["online", "offline", "disabled"] | None = None   # wandb
    dir: str | None = None              # wandb: where its files go (<dir>/wandb/...)
    group: str | None = None            # wandb: run group

    KIND_KEYS: ClassVar[dict[str, str]] = {
        "tracking_uri": "mlflow", "experiment": "mlflow", "project": "wandb",
        "entity": "wandb", "mode": "wandb", "dir": "wandb", "group": "wandb"}

    def __post_init__(self) -> None:
        for key, kind in self.KIND_KEYS.items():
            if kind != self.kind and getattr(self, key) is not None:
                raise ValueError(f"{key}: applies to kind {kind}, not {self.kind}")
        for key, value in self.tags.items():
            if not isinstance(value, str):
                raise ValueError(f"tags.{key}: expected a string, got {value!r}")


def check_trackers(trackers: tuple[TrackerConfig, ...]) -> None:
    """Each kind at most once (the run ids are recorded per kind)."""
    kinds = [t.kind for t in trackers]
    for kind in dict.fromkeys(kinds):
        if kinds.count(kind) > 1:
            raise ValueError(f"run.trackers: {kinds.count(kind)} trackers of kind {kind}; "
                             "list each kind once")


# --------------------------------------------------------------------------- lineage
def run_lineage(recipe: str, config: Mapping[str, Any], *, run_dir: str, prepared_dir: str,
                base_model: str, code_root: str | os.PathLike | None = None,
                context: Mapping[str, str] | None = None) -> dict[str, str]:
    """The lineage a run's trackers are tagged with (`posttrain.lineage` computes the hashes
    as the flows' lineage records do): recipe, config hash, prepared dataset hashes, base
    model, code version; `context` adds (and overrides) what the caller knows, a flow's
    ``metaflow.*`` ids and the hash of its own config."""
    from posttrain.lineage import code_label, code_version, config_hash
    out = {"posttrain.recipe": recipe, "posttrain.run_dir": str(run_dir),
           "posttrain.config_hash": config_hash(config), "posttrain.base_model": base_model}
    produced_by = (config.get("model") or {}).get("produced_by")
    if produced_by:
        out["posttrain.base_model_produced_by"] = produced_by
    manifest = Path(prepared_dir) / "manifest.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        out["posttrain.dataset_hash"] = str(m.get("content_hash", ""))
        out["posttrain.prepare_config_hash"] = str(m.get("config_hash", ""))
    if code_root is not None:
        code = code_version(code_root)
        out["posttrain.code"] = code_label(code)
        if code.get("kind") == "git":
            out["mlflow.source.git.commit"] = code["commit"]
    out.update(context or {})
    return {k: str(v) for k, v in out.items() if v not in (None, "")}


# --------------------------------------------------------------------------- a run's trackers
class Trackers:
    """The started trackers of one run (driver side); a `MetricsWriter` mirror."""

    def __init__(self, trackers: list[Any], path: str, step: int):
        self.trackers, self.path, self.step = list(trackers), path, step
        self.failures = {t.kind: 0 for t in trackers}
        # each tracker's run: its id and where it is (what `trackers.json` records)
        self.runs: dict[str, dict[str, Any]] = {t.kind: t.record for t in trackers}

    def write(self, record: Mapping[str, Any]) -> None:
        """Send a metrics record to every live tracker; an error is a warning (module
        docstring), `MAX_FAILURES` in a row drop the tracker."""
        step = int(record.get("step", 0))
        values = numbers(record)
        self.step = max(self.step, step)
        for t in list(self.trackers):
            try:
                t.log(values, step)
                self.failures[t.kind] = 0
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                self.failures[t.kind] += 1
                dropped = self.failures[t.kind] >= MAX_FAILURES
                log.warning("%s: logging step %d failed (%s: %s)%s", t.where, step,
                            type(e).__name__, e,
                            f"; {MAX_FAILURES} failures in a row: no more logging to "
                            f"{t.kind} in this run (metrics.jsonl has every step)"
                            if dropped else "; training goes on")
                if dropped:
                    self.trackers.remove(t)
                    self._close(t, ok=False)

    def close(self, ok: bool = True) -> None:
        """End every tracker run (FINISHED, or FAILED when the run failed) and record the
        last step logged, where a flow's evaluate step logs its results."""
        for t in self.trackers:
            self._close(t, ok)
        _write_state(self.path, {**_read_state(self.path), "step": self.step,
                                 "finished": ok})
        self.trackers = []

    @staticmethod
    def _close(tracker: Any, ok: bool) -> None:
        try:
            tracker.close(ok)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not end the run (%s: %s)", tracker.where,
                        type(e).__name__, e)


def _state_path(state_dir: str) -> str:
    return f"{str(state_dir).rstrip('/')}/{STATE_FILE}"


def _read_state(path: str) -> dict[str, Any]:
    import fsspec
    fs, p = fsspec.core.url_to_fs(path)
    if not fs.exists(p):
        return {}
    with fs.open(p, "r") as f:
        return json.load(f)


def _write_state(path: str, state: dict[str, Any]) -> None:
    import fsspec
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(p, "w") as f:
        json.dump(state, f, indent=2)


def open_trackers(configs: tuple[TrackerConfig, ...], *, state_dir: str, run_dir: str,
                  start_step: int, config: Mapping[str, Any], lineage: Mapping[str, str],
                  history: list[Mapping[str, Any]] = ()) -> Trackers | None:
    """Start (or, when the run continues from checkpoint `start_step` > 0, resume) the runs of
    the configured trackers; their ids go to ``<state_dir>/trackers.json``. None without
    trackers. A tracker that cannot start raises `TrackerError` (the others are ended).
    `history` (metrics.jsonl up to the checkpoint) is logged again to a resumed tracker that
    may have lost the interrupted attempt's last records (W&B)."""
    if not configs:
        return None
    path = _state_path(state_dir)
    recorded = _read_state(path)
    name = lineage.get("metaflow.pathspec") or Path(run_dir).name
    started: list[Any] = []
    try:
        for i, cfg in enumerate(configs):
            tracker = make_tracker(cfg, f"run.trackers[{i}]", run_dir)
            previous = recorded.get(cfg.kind) if start_step > 0 else None
            if start_step > 0 and previous is None:
                log.warning("run.trackers[%d] (%s): the run continues from step %d, and no "
                            "earlier %s run is recorded in %s: a new one starts here",
                            i, cfg.kind, start_step, cfg.kind, path)
            if start_step == 0 and recorded.get(cfg.kind):
                try:
                    tracker.retire(recorded[cfg.kind])
                except Exception as e:  # noqa: BLE001 - only tidying up
                    log.info("%s: could not mark the earlier run ended: %s", tracker.where, e)
            tracker.start(previous, name=name, config=config, lineage=lineage,
                          start_step=start_step)
            started.append(tracker)
            if previous:
                tracker.replay(list(history), start_step)
    except BaseException:
        for tracker in started:
            Trackers._close(tracker, ok=False)
        raise
    _write_state(path, {t.kind: t.record for t in started})
    for t in started:
        log.info("%s: logging to %s run %s", t.where, t.kind, t.record["run_id"])
    return Trackers(started, path, start_step)


def suite_metrics(table: list[Mapping[str, Any]]) -> dict[str, float]:
    """An evaluation suite's table (`SuiteResult.table`) as tracker metrics:
    ``suite/<task>/<metric>`` (the model), ``suite_baseline/...`` and ``suite_delta/...`` when
    compared (not ``.../<metric>/baseline``: a file store keeps a metric as a file, which
    then could not also be a directory)."""
    out: dict[str, float] = {}
    for row in table:
        for prefix, value in (("suite", row["model"]), ("suite_baseline", row.get("baseline")),
                              ("suite_delta", row.get("delta"))):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}/{row['task']}/{row['metric']}"] = value
    return out


def log_evaluation(configs: tuple[TrackerConfig, ...], state_dir: str,
                   metrics: Mapping[str, float]) -> dict[str, str]:
    """Add `metrics` (an evaluation's results) to the tracker runs a training run recorded in
    ``<state_dir>/trackers.json``, at its last step; the kinds logged to, with their run ids.
    Nothing when no run is recorded (the training had no trackers). Failures are warnings: the
    results are in the evaluation's own report either way."""
    path = _state_path(state_dir)
    recorded = _read_state(path) if configs else {}
    step = int(recorded.get("step", 0))
    done = {}
    for i, cfg in enumerate(configs):
        previous = recorded.get(cfg.kind)
        if not previous:
            continue
        tracker = make_tracker(cfg, f"run.trackers[{i}]", str(state_dir))
        try:
            tracker.reopen(previous)
            tracker.log(numbers(metrics), step)
            tracker.detach()
            done[cfg.kind] = previous["run_id"]
        except Exception as e:  # noqa: BLE001 - the evaluation stands without its tracker
            log.warning("%s: could not log the evaluation to %s run %s (%s: %s)",
                        tracker.where, cfg.kind, previous["run_id"], type(e).__name__, e)
    return done
