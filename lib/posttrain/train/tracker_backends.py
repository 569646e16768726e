"""The experiment-tracker backends behind `posttrain.train.trackers`: one MLflow run
(`MLflowTracker`, through `MlflowClient`) and one W&B run (`WandbTracker`), each with
``start`` (or resume), ``log``, ``replay``, ``close``, and ``reopen`` / ``detach`` / ``retire``
for a flow's evaluate step and an abandoned attempt; and what they are given: a record's
numbers (`numbers`), the config flattened into MLflow params (`flatten`), the lineage as W&B's
short tags (`short_tags`). `make_tracker` builds the one a `TrackerConfig` names. What is
logged when, resume and the failure policy are described in `posttrain.train.trackers`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from posttrain.errors import PosttrainError

if TYPE_CHECKING:                       # trackers builds its backends through this module
    from posttrain.train.trackers import TrackerConfig

__all__ = ["STATE_FILE", "MLflowTracker", "TrackerError", "WandbTracker", "flatten",
           "make_tracker", "numbers", "short_tags"]

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"    # the run's tracker run ids, beside its checkpoints
WANDB_MAX_TAG_CHARS = 64        # W&B refuses longer tags


class TrackerError(PosttrainError):
    """A configured tracker could not start (or resume) its run."""


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


def make_tracker(cfg: TrackerConfig, where: str, run_dir: str) -> Any:
    """The backend of `cfg.kind`, not started."""
    return MLflowTracker(cfg, where) if cfg.kind == "mlflow" else WandbTracker(cfg, where,
                                                                                run_dir)
