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

Both packages are optional (``pip install 'posttrain[trackers]'``) and imported only when
configured; `mlflow-skinny` is enough for a server or a local file store (MLflow 3 asks for
MLFLOW_ALLOW_FILE_STORE=true to use ``file:`` stores).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from posttrain.errors import PosttrainError

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
MAX_FAILURES = 3                # logging errors in a row before a tracker is dropped
WANDB_MAX_TAG_CHARS = 64        # W&B refuses longer tags


class TrackerError(PosttrainError):
    """A configured tracker could not start (or resume) its run."""


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


# --------------------------------------------------------------------------- what is logged
def numbers(record: Mapping[str, Any]) -> dict[str, int | float]:
    """The numeric fields of a metrics record, `step` excluded (booleans are not numbers)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool)}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and text values (lists and null as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


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


def short_tags(lineage: Mapping[str, str]) -> list[str]:
    """Tags in the Metaflow runs' style (`posttrain.lineage.tags_for`) for trackers whose tags
    are plain strings."""
    from posttrain.lineage import SHORT
    tags = [f"recipe:{lineage['posttrain.recipe']}"] if "posttrain.recipe" in lineage else []
    for key, tag in (("posttrain.config_hash", "config"), ("posttrain.dataset_hash", "dataset")):
        if key in lineage:
            tags.append(f"{tag}:{lineage[key][:SHORT]}")
    if "posttrain.code" in lineage:
        tags.append(f"code:{lineage['posttrain.code']}")
    if "metaflow.flow" in lineage and "metaflow.run_id" in lineage:
        tags.append(f"metaflow:{lineage['metaflow.flow']}/{lineage['metaflow.run_id']}")
    return tags


def _require(module: str, package: str, where: str) -> Any:
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(f"{where}: the {module} package is not installed ({e}): "
                           f"pip install {package} (or pip install 'posttrain[trackers]')"
                           ) from None


# --------------------------------------------------------------------------- the trackers
class MLflowTracker:
    """One MLflow run, through `MlflowClient` (no global active run is touched)."""

    kind = "mlflow"
    HINT = ("check tracking_uri / MLFLOW_TRACKING_URI and that the server answers; a local "
            "file store (file:/path) needs MLFLOW_ALLOW_FILE_STORE=true with MLflow 3, and a "
            "database store (sqlite:///x.db, MLflow's default) the full package: pip install "
            "mlflow")

    def __init__(self, cfg: TrackerConfig, where: str):
        self.cfg, self.where = cfg, where
        self.client: Any = None
        self.record: dict[str, Any] = {}

    def _client(self, uri: str | None) -> Any:
        _require("mlflow", "mlflow-skinny", self.where)
        from mlflow.tracking import MlflowClient
        return MlflowClient(tracking_uri=uri)

    def _experiment_id(self) -> str:
        name = self.cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or DEFAULT_EXPERIMENT_ID
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def start(self, previous: dict | None, *, name: str, config: Mapping[str, Any],
              lineage: Mapping[str, str], start_step: int) -> dict[str, Any]:
        uri = self.cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = self._client(uri)
        uri = str(self.client.tracking_uri)
        tags = {**lineage, **self.cfg.tags}
        try:
            if previous:
                try:
                    run = self.client.get_run(previous["run_id"])
                except Exception as e:  # noqa: BLE001 - MlflowException, connection errors
                    raise TrackerError(
                        f"{self.where} (mlflow): this run continues from step {start_step}, "
                        f"and its MLflow run {previous['run_id']} (recorded in {STATE_FILE} "
                        f"beside the checkpoints, at {previous.get('tracking_uri')}) is not at "
                        f"{uri}: {e}. Point tracking_uri at the store that has it, or delete "
                        f"{STATE_FILE} to log the rest into a new run") from None
                self.client.update_run(run.info.run_id, status="RUNNING")
                tags["posttrain.resumed_at_step"] = str(start_step)
            else:
                run = self.client.create_run(self._experiment_id(), run_name=name)
            self.record = {"run_id": run.info.run_id, "tracking_uri": uri,
                           "experiment_id": run.info.experiment_id}
            self._log_params(flatten(config), run.data.params)
            self._log_tags(tags)
        except TrackerError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the store raises, reported as one
            raise TrackerError(f"{self.where} (mlflow): could not start a run at {uri}: "
                               f"{type(e).__name__}: {e}. {self.HINT}") from None
        return self.record

    def _log_params(self, params: dict[str, str], logged: Mapping[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import (MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH,
                                             MAX_PARAMS_TAGS_PER_BATCH)
        changed = [k for k, v in params.items()
                   if k in logged and logged[k] != v[:MAX_PARAM_VAL_LENGTH]]
        if changed:
            log.warning("%s (mlflow): the config changed since the run started (%s); MLflow "
                        "params cannot change, so they keep the first values (result.json "
                        "has this attempt's config)", self.where, ", ".join(changed[:10]))
        new = [Param(_key(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()
               if k not in logged and len(k) <= MAX_ENTITY_KEY_LENGTH]
        run_id = self.record["run_id"]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=new[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def _log_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH
        items = [RunTag(k, v[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.record["run_id"],
                                  tags=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: Mapping[str, int | float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH
        ts = int(time.time() * 1000)
        metrics = [Metric(_key(k), float(v), ts, step) for k, v in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.record["run_id"],
                                  metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def replay(self, history: list[Mapping[str, Any]], start_step: int) -> None:
        """Nothing to replay: each `log` call was stored when it returned."""

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.record["run_id"], "FINISHED" if ok else "FAILED")

    def reopen(self, previous: dict) -> None:
        """Log into a recorded run as it is (a flow's evaluate step, after training)."""
        self.client = self._client(previous.get("tracking_uri"))
        self.client.get_run(previous["run_id"])
        self.record = dict(previous)

    def detach(self) -> None:
        """After `reopen`: the run keeps the status its training gave it."""

    def retire(self, previous: dict) -> None:
        """Mark a run an earlier attempt left RUNNING as KILLED (this attempt starts anew)."""
        client = self._client(previous.get("tracking_uri"))
        if client.get_run(previous["run_id"]).info.status == "RUNNING":
            client.set_terminated(previous["run_id"], "KILLED")


class WandbTracker:
    """One W&B run (`wandb.init(reinit="create_new")`: other runs in the process are left
    alone)."""

    kind = "wandb"
    HINT = ("log in (`wandb login`, or WANDB_API_KEY) and check entity/project, or set mode: "
            "offline (WANDB_MODE=offline) and `wandb sync` later")

    def __init__(self, cfg: TrackerConfig, where: str, run_dir: str):
        self.cfg, self.where, self.run_dir = cfg, where, run_dir
        self.run: Any = None
        self.record: dict[str, Any] = {}
        self.first_step = 0             # steps below it are in the resumed run already

    def start(self, previous: dict | None, *, name: str, config: Mapping[str, Any],
              lineage: Mapping[str, str], start_step: int) -> dict[str, Any]:
        wandb = _require("wandb", "wandb", self.where)
        cfg = self.cfg
        wandb_dir = cfg.dir or os.environ.get("WANDB_DIR") or self.run_dir
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        tags = short_tags(lineage) + [f"{k}:{v}" for k, v in cfg.tags.items()]
        too_long = [t for t in tags if len(t) > WANDB_MAX_TAG_CHARS]
        if too_long:
            log.warning("%s (wandb): tags longer than %d characters dropped (config.posttrain "
                        "has the lineage): %s", self.where, WANDB_MAX_TAG_CHARS, too_long)
        full_config = {**config, "posttrain": {**lineage, **cfg.tags}}
        try:
            self.run = wandb.init(
                project=cfg.project or os.environ.get("WANDB_PROJECT") or "posttrain",
                entity=cfg.entity, group=cfg.group, mode=cfg.mode, dir=wandb_dir,
                name=cfg.name or os.environ.get("WANDB_NAME") or name,
                id=previous["run_id"] if previous else None,
                resume="allow" if previous else None,
                tags=[t for t in tags if len(t) <= WANDB_MAX_TAG_CHARS],
                config=None if previous else full_config, reinit="create_new")
            if previous:
                self.run.config.update(full_config, allow_val_change=True)
                self.run.summary["posttrain.resumed_at_step"] = start_step
                self.first_step = int(self.run.step or 0)
        except Exception as e:  # noqa: BLE001 - wandb's errors (UsageError, CommError, ...)
            raise TrackerError(f"{self.where} (wandb): could not start a run: "
                               f"{type(e).__name__}: {e}. {self.HINT}") from None
        self.record = {"run_id": self.run.id, "project": self.run.project,
                       "entity": self.run.entity or None, "dir": str(wandb_dir),
                       "mode": str(self.run.settings.mode)}
        return self.record

    def log(self, values: Mapping[str, int | float], step: int) -> None:
        if step >= self.first_step:
            self.run.log(dict(values), step=step)

    def replay(self, history: list[Mapping[str, Any]], start_step: int) -> None:
        """Log again the records up to the checkpoint: W&B writes what it was given every
        15 s (`x_transaction_log_flush_interval`), so a killed attempt loses its last steps,
        also ones before the checkpoint. Online, the steps the server has are skipped
        (`first_step`); offline, `wandb sync` keeps the first value of a step."""
        for record in history:
            step = int(record.get("step", 0))
            if step <= start_step:
                self.log(numbers(record), step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def reopen(self, previous: dict) -> None:
        """Log into a recorded run (a flow's evaluate step, after training)."""
        wandb = _require("wandb", "wandb", self.where)
        self.run = wandb.init(project=previous.get("project"), entity=previous.get("entity"),
                              dir=previous.get("dir"), mode=self.cfg.mode or previous.get("mode"),
                              id=previous["run_id"], resume="allow", reinit="create_new")
        self.record = dict(previous)

    def detach(self) -> None:
        self.run.finish()

    def retire(self, previous: dict) -> None:
        """Nothing to do: a W&B run that stops reporting is marked crashed by W&B itself."""


def _key(name: str) -> str:
    """An MLflow metric or param name: its allowed characters only (others become '_')."""
    return re.sub(r"[^/\w.\- :]", "_", name)


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


def _make(cfg: TrackerConfig, where: str, run_dir: str) -> Any:
    return MLflowTracker(cfg, where) if cfg.kind == "mlflow" else WandbTracker(cfg, where,
                                                                                run_dir)


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
            tracker = _make(cfg, f"run.trackers[{i}]", run_dir)
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
        tracker = _make(cfg, f"run.trackers[{i}]", str(state_dir))
        try:
            tracker.reopen(previous)
            tracker.log(numbers(metrics), step)
            tracker.detach()
            done[cfg.kind] = previous["run_id"]
        except Exception as e:  # noqa: BLE001 - the evaluation stands without its tracker
            log.warning("%s: could not log the evaluation to %s run %s (%s: %s)",
                        tracker.where, cfg.kind, previous["run_id"], type(e).__name__, e)
    return done
