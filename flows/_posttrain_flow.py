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
- `@ray_nodes()`: a `StepMutator` that turns the step called with `num_parallel` into a
  `@metaflow_ray` step when the config asks for several nodes, and a plain one-node `@parallel`
  step otherwise (that one starts its own local Ray, so it also runs on the local datastore).
- `storage_root`, `scratch_dir`, `publish`, `fetch`: where a run's datasets, checkpoints and
  weights go (local directory or the S3 data root), keyed by the run, never by the attempt;
  `train_recipe` runs a training driver of `steps/` with that layout and draws its training
  card; `storage_and_nodes` is a recipe flow's start step.
- `ray_cluster`: joins the Ray cluster `@metaflow_ray` formed and stops, by PID, the Ray
  processes of that cluster on this machine when the step ends (metaflow-ray leaves them
  running, and the next run on the machine then cannot start Ray).
- `record_lineage`, `lineage_card`: the end step's `lineage` artifact (datasets and their
  hashes, parent runs, resolved config and its hash, code version, outputs), the run's
  `dataset:`/`config:`/`model:`/`parent:` tags, and a card drawing the chain of runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

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

from metaflow import FlowMutator, StepMutator  # noqa: E402


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


# --------------------------------------------------------------------------- Ray nodes
class ray_nodes(StepMutator):
    """`@metaflow_ray` over `config.run.num_nodes` nodes, or a one-node `@parallel` step."""

    def init(self, config_name: str = "config", all_nodes_started_timeout: int = 300):
        self.config_name = config_name
        self.timeout = all_nodes_started_timeout

    def pre_mutate(self, mutable_step) -> None:
        # pre_mutate, not mutate: the graph linter (which checks that a num_parallel call
        # leads to a @parallel step) runs between the two.
        cfg = getattr(mutable_step.flow, self.config_name)
        gpus = gpus_per_node(cfg)
        if gpus:
            # read by @kubernetes (run --with kubernetes, Argo Workflows) for every node of the
            # step, control and workers alike; ignored by local runs
            mutable_step.add_decorator("resources", deco_kwargs={"gpu": gpus})
        if int(cfg.run.num_nodes) > 1:
            mutable_step.add_decorator(
                "metaflow_ray", deco_kwargs={"all_nodes_started_timeout": self.timeout})
            # Ray >= 2.5x turns token auth on for `ray start --head` when ~/.ray/auth_token
            # exists (any earlier local `ray.init()` writes one), but `ray start --address`
            # on the other nodes does not load it, so they cannot join. The cluster is private
            # to this step's tasks; set RAY_AUTH_MODE at launch to choose otherwise.
            mutable_step.add_decorator("environment", deco_kwargs={"vars": {
                "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}})
        else:
            mutable_step.add_decorator("parallel")


def gpus_per_node(cfg: Any) -> int:
    """GPUs one node of a training step needs: its share of the GPUs of the Ray trainer
    workers, plus those of separately placed rollout engines (GRPO)."""
    import math
    run = cfg.run
    total = int(run.num_workers) * float(dict(run.resources_per_worker or {}).get("GPU", 0))
    rollout = cfg.get("rollout") if hasattr(cfg, "get") else getattr(cfg, "rollout", None)
    if rollout and rollout.get("placement") == "separate":
        per_engine = dict(rollout.get("resources_per_engine") or {})
        total += int(rollout.get("num_engines", 1)) * float(per_engine.get("num_gpus", 0))
    return math.ceil(total / int(run.num_nodes))


@contextlib.contextmanager
def ray_cluster(num_nodes: int, run: Any = None) -> Iterator[None]:
    """Join `@metaflow_ray`'s cluster (several nodes) and stop its processes here at the end.

    With one node nothing is joined: the training step starts its own local Ray, and with the
    run's `run` config section it starts now, in the background (`steps.common.start_local_ray`),
    while the block imports the driver and prepares; it is stopped when the block ends.
    """
    if num_nodes <= 1:
        from steps.common import start_local_ray, stop_local_ray
        if run is not None:
            start_local_ray(run)
        try:
            yield
        finally:
            stop_local_ray()
        return
    import ray
    ray.init(log_to_driver=True)            # no address: the cluster metaflow_ray started
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    try:
        yield
    finally:
        ray.shutdown()
        stopped = stop_ray_processes(session_dir)
        print(f"stopped {len(stopped)} Ray processes of {session_dir} on this machine")


def stop_ray_processes(session_dir: str, timeout_s: float = 15.0) -> list[int]:
    """Terminate (then kill) the processes whose command line names `session_dir`.

    Every Ray daemon and worker process of a session (gcs_server, raylet, dashboard, agents,
    actors) carries its session directory on the command line, and a session directory
    belongs to one cluster, so this stops exactly what that cluster started on this machine.
    """
    import psutil
    me = os.getpid()
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != me and session_dir in " ".join(p.info["cmdline"] or ()):
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [p.pid for p in procs]


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
        changes["model"] = dataclasses.replace(cfg.model, hf_dir=fetch(start_from), init=None)
    cfg = dataclasses.replace(cfg, **changes)
    started = time.time()
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


# --------------------------------------------------------------------------- cards
def training_card(card: Any, recipe: str, records: list[dict], result: dict) -> None:
    """The training report of any recipe: its summary table and curves (loss, tokens/s, MFU,
    memory for the recipes of the kernel; reward, KL, lengths, sync and phases for GRPO)."""
    from metaflow import current
    from metaflow.cards import Markdown, Table, VegaChart

    from posttrain.train.card import grpo_charts, grpo_summary, training_charts, training_summary
    card.append(Markdown(f"# {recipe.upper()} training: {current.flow_name}/{current.run_id}"))
    grpo = recipe == "grpo"
    card.append(Table((grpo_summary if grpo else training_summary)(records),
                      headers=["", "value"]))
    for spec in (grpo_charts if grpo else training_charts)(records):
        card.append(VegaChart(spec))
    samples = result.get("eval_records") or []
    if grpo and samples:
        card.append(Markdown("## Held-out completions at the end (greedy)"))
        keys = [k for k in samples[0] if k != "prompt"]
        card.append(Table([[s["prompt"], *[s[k] for k in keys]] for s in samples],
                          headers=["prompt", *keys]))
    if result.get("eval") and not grpo:
        card.append(Markdown("In-training held-out evaluation: " + ", ".join(
            f"{k}={v:.4g}" for k, v in result["eval"].items() if isinstance(v, float))))


def _code_root() -> Path:
    """The repository root here; the package root (the task's directory) in a remote task."""
    here = Path(__file__).resolve().parent
    return here.parent if (here.parent / "lib" / "posttrain").is_dir() else here


def _code_package() -> dict:
    """What Metaflow knows of the shipped code package: its sha (set for remote tasks) and its
    INFO (with the git commit of the checkout it was built from, when it was one)."""
    from metaflow.packaging_sys import MetaflowCodeContent
    return {"sha": os.environ.get("METAFLOW_CODE_SHA"), "info": MetaflowCodeContent.get_info()}


def record_lineage(flow: Any, *, outputs: dict, parents: list | tuple = (),
                   started_from: dict | None = None, datasets: list | None = None,
                   config: dict | None = None) -> dict:
    """The run's lineage (`posttrain.lineage.Lineage` as a dict), for the end step to store.

    Datasets come from the prepare step's artifacts (`prepared_uri`, `content_hash`,
    `manifest_summary`) unless given (`posttrain.lineage.raw_dataset_ref` for data read
    without a prepare step), the config from `flow.config` unless given, the code version
    from git or the code package. Also tags the run (`dataset:`, `config:`, `code:`,
    `model:`, `parent:`) and writes `lineage.json` next to the run's outputs in its storage
    root, so weights found in storage lead back to the run.
    """
    import warnings

    from metaflow import current
    from metaflow.exception import MetaflowTaggingError

    from posttrain.lineage import build_lineage, code_version, dataset_ref, tags_for
    if datasets is None:
        summary = flow.manifest_summary
        datasets = [dataset_ref(prepared_uri=flow.prepared_uri, content_hash=flow.content_hash,
                                config_hash=summary.get("config_hash", ""),
                                sources=summary.get("sources"))]
    origin = current.origin_run_id
    lineage = build_lineage(
        f"{current.flow_name}/{current.run_id}",
        config=flow.config.to_dict() if config is None else config,
        datasets=datasets, code=code_version(_code_root(), _code_package()), outputs=outputs,
        parents=parents, started_from=started_from,
        resumed_from=f"{current.flow_name}/{origin}" if origin else None)
    tags = tags_for(lineage)
    try:
        current.run.add_tags(tags)
    except MetaflowTaggingError as e:           # e.g. the user's own tags leave no room
        warnings.warn(f"the run could not be tagged with its lineage ({e}); the `lineage` "
                      f"artifact has it all", stacklevel=2)
    record = lineage.to_dict()
    uri = publish_json(record, join(flow.storage_root, "lineage.json"))
    print(f"lineage: {uri}\ntags: {' '.join(tags)}")
    return record


def lineage_card(card: Any, lineage: dict) -> None:
    """The run and the runs behind it: a tree, a table and a graph (parents via the client)."""
    from metaflow.cards import Markdown, Table, VegaChart

    from posttrain.lineage import lineage_card_spec, walk
    from steps.lineage import load_from_metaflow
    spec = lineage_card_spec(walk(lineage["pathspec"], load_from_metaflow, root=lineage))
    card.append(Markdown(f"# {spec['title']}"))
    card.append(Markdown("```\n" + spec["tree_text"] + "\n```"))
    card.append(Table(spec["table"]["rows"], headers=spec["table"]["headers"]))
    card.append(VegaChart(spec["graph"]))


# --------------------------------------------------------------------------- evaluation suites
def resolve_checkpoint(what: str, run_pathspec: str, directory: str) -> tuple[str, str | None]:
    """(checkpoint URI, parent run pathspec or None) from a finished run's `hf_uri` artifact
    or a directory: exactly one of the two (`--<what>-run` / `--<what>-dir`)."""
    if bool(run_pathspec) == bool(directory):
        raise ValueError(f"give exactly one of --{what}-run (a run pathspec such as "
                         f"SFTFlow/1234) and --{what}-dir (a checkpoint directory)")
    if directory:
        return directory, None
    from metaflow import Run
    run = Run(run_pathspec)
    if not run.successful:
        raise ValueError(f"--{what}-run {run_pathspec} did not finish successfully")
    if "hf_uri" not in run.data:
        raise ValueError(f"--{what}-run {run_pathspec} has no `hf_uri` artifact (an exported "
                         "checkpoint); give a training run")
    return run.data.hf_uri, run.pathspec


def start_model(config: Any, run_pathspec: str, flow_name: str, flow_file: str
                ) -> tuple[str | None, str]:
    """A flow's start step that trains on from another flow's export: (parent run pathspec or
    None, the checkpoint URI): the export of the finished run `run_pathspec` when given, else
    the config's `model.hf_dir`, which must then exist (else the run stops here, naming the
    flow that makes it)."""
    from metaflow import Run
    from metaflow.exception import MetaflowException
    if run_pathspec:
        parent = Run(run_pathspec)
        if not parent.successful:
            raise MetaflowException(f"{run_pathspec} did not finish successfully")
        return parent.pathspec, parent.data.hf_uri
    hf_dir = config.model.hf_dir
    if not (is_remote(hf_dir) or (Path(hf_dir) / "config.json").is_file()):
        raise MetaflowException(
            f"model.hf_dir: {hf_dir}/config.json not found, nothing was run. Start from a "
            f"finished {flow_name} run (`python {flow_file} run`) with its pathspec as "
            f"--{flow_name.removesuffix('Flow').lower()}-run {flow_name}/<run id>")
    return None, hf_dir


def with_model(config: Any, hf_uri: str) -> dict:
    """`config` as a plain dict whose model is a local copy of `hf_uri` (for a step that reads
    the model's files, e.g. the event vocabulary beside it)."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {**cfg, "model": {**cfg["model"], "hf_dir": fetch(hf_uri)}}


def find_base_model(model: Any, sft_schema: str) -> tuple[str | None, str, dict | None]:
    """A flow's start step, when no run was given: where its config's `model.hf_dir` is.

    Returns (parent run pathspec or None, checkpoint URI, SFT config to train or None): the
    directory itself when it exists; else, when `model.produced_by` names the SFT config that
    makes it, the export of the newest successful SFTFlow run of that config (tag
    `config:<hash>`), or that config for the run to train first (the URI is then a
    placeholder the training replaces). Anything else missing stops the run here, before
    any work, with the command that makes it."""
    from metaflow.exception import MetaflowException

    from posttrain.lineage import SHORT, config_hash
    hf_dir = model.hf_dir
    if is_remote(hf_dir) or (Path(hf_dir) / "config.json").is_file():
        return None, hf_dir, None
    if not model.produced_by:
        raise MetaflowException(
            f"model.hf_dir: {hf_dir}/config.json not found. Start from a finished run with "
            "--sft-run SFTFlow/<run id>, or set model.produced_by to the SFT config that makes "
            "it (this flow then finds the newest run of it, or trains it)")
    source = Path(model.produced_by)
    if not source.is_file():
        raise MetaflowException(f"model.produced_by: {source} not found (the SFT config whose "
                                f"export model.hf_dir {hf_dir} is)")
    sft = parse_config(sft_schema)(source.read_text())
    tag = f"config:{config_hash(sft)[:SHORT]}"
    run = promoted_run("SFTFlow", tag) or _run_with_config("SFTFlow", sft, sft_schema)
    if run is not None:
        print(f"{hf_dir} is not on this disk; starting from the newest successful SFTFlow run "
              f"of {source} ({tag}): {run.pathspec}")
        return run.pathspec, run.data.hf_uri, None
    print(f"{hf_dir} is not on this disk and no successful SFTFlow run of {source} ({tag}) was "
          f"found: the base step trains it first (the same as `python flows/sft_flow.py "
          f"--config config {source} run`)")
    return None, hf_dir, sft


def _run_with_config(flow_name: str, config: dict, schema: str, newest: int = 50) -> Any:
    """The newest successful run of `flow_name` among the last `newest` whose config, read
    with today's schema, is `config`: a run made before a field was added to the schema
    carries another `config:` tag, yet ran the same recipe."""
    from metaflow import Flow, namespace
    from metaflow.exception import MetaflowNotFound

    from posttrain.config.loader import build, to_dict
    namespace(None)
    try:
        runs = Flow(flow_name).runs()
    except MetaflowNotFound:
        return None
    for i, run in enumerate(runs):         # newest first
        if i == newest:
            return None
        if not run.successful:
            continue
        try:
            then = run["start"].task.data.config
            if to_dict(build(_schema(schema), dict(then), where="config")) == config:
                return run
        except Exception:                   # a config the schema no longer reads: not this one
            continue
    return None


def suite_card(card: Any, result: dict, records: dict[str, list[dict]],
               samples_per_task: int = 8) -> None:
    """The comparison table, a chart of model vs baseline per metric, and per-task samples."""
    from metaflow import current
    from metaflow.cards import Markdown, Table, VegaChart

    from posttrain.train.card import comparison_chart, comparison_rows, record_rows
    card.append(Markdown(f"# Evaluation: {current.flow_name}/{current.run_id}\n\n"
                         f"model `{result['model_uri']}`, baseline `{result['baseline_uri']}`"))
    card.append(Table(comparison_rows(result["table"]),
                      headers=["task", "metric", "model", "baseline", "delta"]))
    card.append(VegaChart(comparison_chart(result["table"])))
    for name, task in result["tasks"].items():
        headers, rows = record_rows(records.get(name, []), samples_per_task)
        card.append(Markdown(f"## {name} ({task['kind']}): first {len(rows)} of "
                             f"{task['num_samples']} samples"))
        if rows:
            card.append(Table(rows, headers=headers))


def promoted_run(flow_name: str, tag: str, exclude: str | None = None) -> Any:
    """The newest successful run of `flow_name` carrying `tag` (any namespace), or None."""
    from metaflow import Flow, namespace
    from metaflow.exception import MetaflowNotFound
    namespace(None)                 # promotion is global: scheduled runs have their own namespace
    try:
        flow = Flow(flow_name)
    except MetaflowNotFound:
        return None
    for run in flow.runs(tag):      # newest first
        if run.id != str(exclude) and run.successful:
            return run
    return None
