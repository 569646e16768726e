"""Runs that came before: where a flow's starting checkpoint comes from (a finished run's
export, a directory, the config's `model.hf_dir`, or the newest successful run of the SFT
config that makes it, `model.produced_by`), and the newest promoted run of a flow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _posttrain_flow import _schema, fetch, is_remote, parse_config


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
