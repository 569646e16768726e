"""The flows' cards and lineage: the training card of any recipe, the evaluation suite's
comparison card, and the end step's `lineage` artifact (datasets and their hashes, parent runs,
resolved config and its hash, code version, outputs) with the run's `dataset:`/`config:`/
`model:`/`parent:` tags and a card drawing the chain of runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from _posttrain_flow import join, publish_json


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
