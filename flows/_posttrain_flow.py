"""What every posttrain flow shares: config parsing, the code package, Ray nodes, run storage.

Kept out of the flow files so that they read as a table of contents:

- `parse_config(SchemaClass)`: a `Config(parser=...)` that reads YAML with `yaml.safe_load` and
  validates it against the recipe's strict schema when the flow is launched, so an unknown key
  fails before any step runs, naming the key; the resolved config (defaults filled in) is what
  steps see.
- `@ship_repo(...)`: a `FlowMutator` that puts `lib/`, `steps/`, `configs/` and `assets/` into the
  code package Metaflow ships to remote tasks (by default it only packs the flow's directory,
  and only `.py` files), at the same relative paths as in the repository, so relative paths in
  configs mean the same thing in a pod as on a laptop.
- `storage_root`, `scratch_dir`, `publish`, `fetch`: where a run's datasets, checkpoints and
  weights go (local directory or the S3 data root), keyed by the run, never by the attempt;
  `train_recipe` runs a training driver of `steps/` with that layout and draws its training
  card; `storage_and_nodes` is a recipe flow's start step.

Beside it: `_flow_ray.py` (`@ray_nodes` and the Ray cluster of a training step),
`_recipe_flow.py` (the start, prepare and join steps of every recipe flow),
`_flow_cards.py` (training and evaluation cards, the end step's lineage record and card) and
`_flow_runs.py` (where a flow's starting checkpoint comes from: earlier runs, `produced_by`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

REPO_DIRS = ("lib", "steps", "configs", "assets")
_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".jsonl", ".jinja", ".txt", ".model")


def _make_importable() -> None:
    """In a remote task the repo's `lib/` arrives in the code package, not installed."""
    try:
        import posttrain  # noqa: F401
    except ImportError:
        here = Path(__file__).resolve().parent
        sys.path.insert(0, str(here / "lib"))


_make_importable()

from metaflow import FlowMutator  # noqa: E402

from posttrain.process import tune_cycle_collector  # noqa: E402

tune_cycle_collector()      # every task of a flow imports this module: the task's process


# --------------------------------------------------------------------------- config
def _schema(dotted: str) -> type:
    import importlib
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def parse_config(schema: str) -> Callable[[str], dict]:
    """A `Config` parser: YAML text -> validated, resolved plain dict (defaults filled in).

    `schema` is the dotted name of the recipe's config dataclass, imported when the config is
    parsed (at launch), not when the flow file is imported.
    """

    def parse(text: str) -> dict:
        import yaml

        from posttrain.config.loader import build, to_dict
        from posttrain.errors import ConfigError
        try:
            data = yaml.safe_load(text) or {}
            if not isinstance(data, dict):
                raise ConfigError(f"config: the top level must be a mapping, got "
                                  f"{type(data).__name__}")
            return to_dict(build(_schema(schema), data, where="config"))
        except ValueError as e:                 # ConfigError is one
            # A MetaflowException is reported as a one-line error before anything runs.
            from metaflow.exception import MetaflowException
            detail = str(e) if isinstance(e, ConfigError) else f"config: {e}"
            raise MetaflowException(f"invalid config: {detail}") from None

    parse.__name__ = f"parse_{schema.rpartition('.')[2]}"
    return parse


def build_config(schema: str, config: Any) -> Any:
    """The frozen recipe config from a step's `self.config` (already validated at launch)."""
    from posttrain.config.loader import build
    return build(_schema(schema), config.to_dict() if hasattr(config, "to_dict") else dict(config),
                 where="config")


# --------------------------------------------------------------------------- code package
class ship_repo(FlowMutator):
    """Add the repository's `lib/`, `steps/`, `configs/`, `assets/` to the code package."""

    def init(self, *dirs: str):
        self.dirs = dirs or REPO_DIRS

    def add_to_package(self):
        from metaflow.packaging_sys import ContentType
        repo = Path(__file__).resolve().parent.parent
        for name in self.dirs:
            top = repo / name
            for path in sorted(top.rglob("*")):
                if (path.is_file() and path.suffix in _SUFFIXES
                        and "__pycache__" not in path.parts and not path.name.startswith(".")
                        and not any(p.endswith(".egg-info") for p in path.parts)):
                    # arcnames are relative to the flow's directory, which is the package
                    # root (and the task's working directory) remotely: the package mirrors
                    # the repository, so `configs/...` and `assets/...` resolve the same way.
                    yield str(path), os.path.relpath(path, repo), ContentType.USER_CONTENT


# --------------------------------------------------------------------------- storage
def storage_root(flow: Any, run_dir: str) -> str:
    """Where this run's datasets, checkpoints and weights live (local path or s3:// URI).

    `run.dir` when it is a URI; under the S3 data root when the run uses the S3 datastore
    (every node and every later step can reach it); else `run.dir` on this machine. Computed
    once in `start`: a retried or resumed task reads it back from the cloned artifact, so its
    checkpoints are found again.
    """
    from metaflow import current
    suffix = f"{current.flow_name}/{current.run_id}"
    if "://" in run_dir:
        return f"{run_dir.rstrip('/')}/{suffix}"
    if getattr(flow._datastore, "TYPE", "local") == "s3":
        from metaflow.metaflow_config import DATASTORE_SYSROOT_S3, DATATOOLS_S3ROOT
        base = DATATOOLS_S3ROOT or f"{DATASTORE_SYSROOT_S3.rstrip('/')}/data"
        return f"{base.rstrip('/')}/posttrain/{suffix}"
    return str(Path(run_dir).resolve() / suffix)


def is_remote(uri: str) -> bool:
    return "://" in uri


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


class Prepared(NamedTuple):
    """The small artifacts a flow keeps of its prepare step (the shards stay in storage)."""

    prepared_uri: str
    content_hash: str
    manifest_summary: dict
    shard_uris: list[str]


def prepare_data(schema: str, config: Any, storage_root: str) -> Prepared:
    """The prepare step of every recipe flow: tokenize `config`'s data into <root>/prepared.

    Returns the prepared URI, the dataset content hash, a manifest summary and the shard URIs.
    """
    from posttrain.config.recipes import OutputConfig, PrepareConfig
    from steps import prepare
    cfg = build_config(schema, config)
    uri = join(storage_root, "prepared")
    output = OutputConfig(dir=uri)
    # what the recipe prepares: its tokenizer and data, or what its `prepare_config` says
    # (event sequences: a vocabulary and the labels of its heads), as `steps.common` does
    pcfg = (cfg.prepare_config(output) if hasattr(cfg, "prepare_config") else
            PrepareConfig(tokenizer=cfg.tokenizer, data=cfg.data, output=output))
    manifest = prepare.run(pcfg, show_progress=False)
    print(prepare.summarize(manifest))
    paths = {(split, src.name or f"source{i}"): src.path if isinstance(src.path, str)
             else list(src.path)        # named as in steps.prepare
             for split in ("train", "eval") for i, src in enumerate(getattr(cfg.data, split))}
    sources = [{"split": s["split"], "name": s["name"], "path": paths.get((s["split"], s["name"])),
                "files": len(s["files"]), "rows": s["rows_written"],
                "content_hash": s["content_hash"]} for s in manifest["sources"]]
    return Prepared(uri, manifest["content_hash"],
                    {"totals": manifest["totals"], "format": manifest["format"],
                     "config_hash": manifest["config_hash"],
                     "vocab_size": manifest["tokenizer"].get("vocab_size"), "sources": sources},
                    [sh["uri"] for src in manifest["sources"] for sh in src["shards"]])


def scratch_dir(root: str, name: str) -> str:
    """A local working directory for `name`: inside a local root, else stable per root."""
    if not is_remote(root):
        return join(root, name)
    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "posttrain-runs", key, name)


def check_inputs(config: Any, schema: str | None = None) -> None:
    """A start step: the config's data files and tokenizer given by relative paths (inside the
    repository, shipped with the code package) exist, or the run stops here, before any work,
    naming each missing one and what makes it. Absolute paths (a cluster's mounts), URIs and
    globs are checked where they are read. With the recipe's `schema`, its memory plan must
    also fit the declared devices (`check_plan`)."""
    from metaflow.exception import MetaflowException
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    wanted = [("tokenizer.path", (cfg.get("tokenizer") or {}).get("path"))]
    for split in ("train", "eval"):
        for i, src in enumerate((cfg.get("data") or {}).get(split) or []):
            paths = [src["path"]] if isinstance(src["path"], str) else list(src["path"])
            wanted += [(f"data.{split}[{i}].path", p) for p in paths]
    missing = [f"{key}: {path} not found" + (
        " (bundled data: `make assets` writes it)" if str(path).startswith("assets/") else "")
        for key, path in wanted
        if path and not is_remote(str(path)) and not Path(path).is_absolute()
        and not any(c in str(path) for c in "*?[") and not Path(path).exists()]
    if missing:
        raise MetaflowException("missing inputs, nothing was run:\n  " + "\n  ".join(missing))
    if schema is not None:
        check_plan(config, schema)


def check_plan(config: Any, schema: str) -> None:
    """Stop the run when its memory plan does not fit the declared devices (`run.gpu`, or this
    machine's RAM on a CPU run), naming the part and the knobs that would make it fit;
    `run.plan_check: warn` or `off` launches anyway (`posttrain.plan.check`)."""
    from metaflow.exception import MetaflowException

    from posttrain.plan import PlanError, check_run
    try:
        check_run(build_config(schema, config))
    except PlanError as e:
        raise MetaflowException(f"nothing was run: {e}") from None


def storage_and_nodes(flow: Any, schema: str | None = None) -> tuple[str, int]:
    """A recipe flow's start step: the inputs and (with `schema`) the memory plan checked, this
    run's storage root (retries and `resume` read it back from the artifact) and how many
    nodes its train step spans."""
    check_inputs(flow.config, schema)
    root = storage_root(flow, flow.config.run.dir)
    nodes = int(flow.config.run.num_nodes)
    print(f"storage: {root}; {nodes} node(s), {flow.config.run.num_workers} worker(s)")
    return root, nodes


def train_recipe(step_module: str, schema: str, config: Any, prepared_uri: str, root: str,
                 name: str, num_nodes: int = 1, card: Any = None,
                 start_from: str | None = None) -> dict[str, Any]:
    """A recipe flow's train step: the driver of `steps.<step_module>` on the validated config
    (starting from the checkpoint at `start_from`, a local or s3:// directory, instead of the
    config's model when given), inside the Ray cluster of the step's nodes, its working
    directory in local scratch and its checkpoints under `root/name` (so a retried attempt or
    `resume` continues from them). Publishes the export and the metrics under `root/name`,
    draws the training card on `card`, prints the summary. Returns the driver's result with
    `hf_uri`, `metrics_uri` and `checkpoint_uri` added."""
    import dataclasses
    import importlib
    import time

    from steps.cli import configure_logging
    from steps.common import summarize
    configure_logging()                          # the driver's step lines in the task's log
    cfg = build_config(schema, config)
    changes = {"run": dataclasses.replace(cfg.run, dir=scratch_dir(root, name))}
    if start_from:
        changes["model"] = cfg.model.starting_from(fetch(start_from))
    cfg = dataclasses.replace(cfg, **changes)
    started = time.time()
    from _flow_ray import ray_cluster
    with ray_cluster(num_nodes, cfg.run):        # a local Ray starts while the driver imports
        module = importlib.import_module(f"steps.{step_module}")
        result = module.run(cfg, prepared_dir=prepared_uri, checkpoint_dir=join(root, name),
                            show_progress=False,
                            lineage=tracker_lineage(config) if cfg.run.trackers else None)
    result["hf_uri"] = publish(result["hf_dir"], join(root, name, "hf"))
    # the starting checkpoint, for the evaluation's comparison: where it already lives, or
    # the random init the driver made, published beside the export
    result["base_model_uri"] = (start_from or cfg.model.hf_dir or
                                publish(result["base_model_dir"], join(root, name, "base_model")))
    result["metrics_uri"] = publish(result["metrics_path"], join(root, name, "metrics.jsonl"))
    result["checkpoint_uri"] = result["checkpoint_dir"]
    if card is not None:
        from _flow_cards import training_card
        from posttrain.train.metrics import read_metrics
        training_card(card, module.RECIPE.name, read_metrics(result["metrics_path"]), result)
    print(summarize(module.RECIPE, result, time.time() - started))
    return result


def tracker_lineage(config: Any) -> dict[str, str]:
    """What this Metaflow task adds to a training run's tracker tags (`run.trackers`): its
    ids, and the config hash the end step's lineage record has (the flow's config, before the
    train step points run.dir at scratch)."""
    from metaflow import current

    from posttrain.lineage import config_hash
    out = {"metaflow.flow": current.flow_name, "metaflow.run_id": str(current.run_id),
           "metaflow.step": current.step_name, "metaflow.task_id": str(current.task_id),
           "metaflow.pathspec": f"{current.flow_name}/{current.run_id}",
           "posttrain.config_hash": config_hash(
               config.to_dict() if hasattr(config, "to_dict") else dict(config))}
    if current.origin_run_id:
        out["metaflow.origin_run_id"] = str(current.origin_run_id)
    return out


def evaluate_recipe(step_module: str, schema: str, config: Any, model_uri: str,
                    baseline_uri: str | None, root: str, card: Any, *,
                    models: dict[str, str] | None = None, provenance: dict | None = None
                    ) -> dict[str, Any]:
    """A recipe flow's evaluate step: the recipe's held-out suite (`Recipe.eval_suite`, run by
    the one evaluation step `steps.evaluate`) on the exported checkpoint against
    `baseline_uri` (None: no comparison), published as `root`/eval.json and drawn on `card`.
    `models` are the run's other checkpoints by role (a teacher). Returns the suite result as
    a dict (table, tasks with their records) with `eval_uri` and `provenance` added."""
    import importlib

    from steps import evaluate
    module = importlib.import_module(f"steps.{step_module}")
    cfg = build_config(schema, config)
    suite = module.RECIPE.eval_suite(cfg, {k: fetch(v) for k, v in (models or {}).items()})
    if suite is None:
        raise ValueError(f"the {module.RECIPE.name} flow evaluates on data.eval: configure "
                         "held-out data")
    result = evaluate.run(suite, fetch(model_uri), fetch(baseline_uri) if baseline_uri else None)
    print(evaluate.summarize(result))
    full = {**result.to_dict(), "model_uri": model_uri, "baseline_uri": baseline_uri,
            "provenance": {"model_uri": model_uri, "baseline_uri": baseline_uri,
                           **(provenance or {}),
                           "config": config.to_dict() if hasattr(config, "to_dict")
                           else dict(config)}}
    full["eval_uri"] = publish_json(full, join(root, "eval.json"))
    if cfg.run.trackers:        # the training's tracker runs, recorded beside its export
        from posttrain.train.trackers import log_evaluation, suite_metrics
        log_evaluation(cfg.run.trackers, model_uri.rstrip("/").rsplit("/", 1)[0],
                       suite_metrics(full["table"]))
    records = {name: task["records"] for name, task in full["tasks"].items()}
    from _flow_cards import suite_card
    suite_card(card, full, records)
    return full


def heldout_metrics(metrics: dict, model_uri: str, root: str, card: Any, *,
                    provenance: dict | None = None) -> tuple[dict[str, float], str]:
    """A recipe flow's evaluate step when the recipe has no evaluation suite (event
    sequences): the held-out metrics its train step computed on `data.eval` with the weights
    it exported, published as `root`/eval.json and drawn on `card` as a table. Returns the
    numeric metrics and the URI."""
    from metaflow import current
    from metaflow.cards import Markdown, Table
    values = {k: float(v) for k, v in sorted((metrics or {}).items())
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not values:
        raise ValueError("the train step computed no held-out metrics: configure data.eval")
    uri = publish_json({"model_uri": model_uri, "metrics": values,
                        "provenance": {"model_uri": model_uri, **(provenance or {})}},
                       join(root, "eval.json"))
    card.append(Markdown(f"# Held-out evaluation: {current.flow_name}/{current.run_id}\n\n"
                         f"model `{model_uri}`"))
    card.append(Table([[k, round(v, 6)] for k, v in values.items()], headers=["metric", "value"]))
    return values, uri


def train_summary(result: dict, *extra: str) -> dict[str, Any]:
    """The small `train_result` artifact of a driver's result: steps, throughput, evaluation."""
    keys = ("steps", "started_at_step", "final_loss", "mean_real_tokens_per_s", "mean_mfu",
            "eval", "model", "seconds", *extra)
    return {k: result.get(k) for k in keys}


def publish(local_path: str, uri: str) -> str:
    """Copy a local file or directory to `uri` (no-op when it is already there)."""
    if not is_remote(uri) and os.path.abspath(local_path) == os.path.abspath(uri):
        return uri
    import fsspec
    fs, path = fsspec.core.url_to_fs(uri)
    if os.path.isdir(local_path):
        fs.put(local_path.rstrip("/") + "/", path.rstrip("/"), recursive=True)
    else:
        fs.put_file(local_path, path)
    return uri


def fetch(uri: str) -> str:
    """A local copy of a directory at `uri` (the directory itself when it is local)."""
    if not is_remote(uri):
        return uri
    import fsspec
    fs, path = fsspec.core.url_to_fs(uri)
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    base = os.path.join(tempfile.gettempdir(), "posttrain-fetch")
    out = os.path.join(base, key)
    if not os.path.isdir(out):
        os.makedirs(base, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"{key}.", dir=base)
        fs.get(path.rstrip("/") + "/", tmp.rstrip("/") + "/", recursive=True)
        with contextlib.suppress(OSError):          # another task fetched it first
            os.rename(tmp, out)
    return out


def publish_json(obj: Any, uri: str) -> str:
    """Write `obj` as JSON to `uri` (local path or s3://)."""
    import json
    import fsspec
    with fsspec.open(uri, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    return uri

