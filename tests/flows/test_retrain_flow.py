"""The scheduled retraining flow, run twice locally through Metaflow's Runner:

1. nothing is promoted yet: the candidate trained on the newest snapshot is promoted (tagged);
2. a new snapshot arrives and the recipe is made worse (2 steps instead of 4): the candidate
   loses to the promoted model on the held-out split, is refused with the reason, and the tag
   stays where it was;
3. the recipe is made better (8 steps): that run is SIGKILLed once its train step has
   committed checkpoint 4 and continued with `resume`, which exports the same bytes as an
   uninterrupted run (the SFT driver on the same recipe) and records `resumed_from`; the
   candidate beats the promoted model by the margin and takes the `promoted` tag from it.
   One run answers both questions (the resume of this flow, test_resume_flow.py's for the
   others, and the move of the tag).

The schedule itself is checked offline in tests/infra/test_argo_specs.py (the cron of the
deployed WorkflowTemplate).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import (REPO, get_card, reference_export, resume, run_and_kill,
                       safetensors)

RETRAIN_FLOW = REPO / "flows" / "retrain_flow.py"
SNAPSHOTS = REPO / "assets" / "data" / "snapshots" / "arithmetic"


def test_retrain_config_passes_the_schema():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    resolved = parse_config("posttrain.retrain.RetrainConfig")(
        (REPO / "configs/retrain/tiny.yaml").read_text())
    assert resolved["gate"] == {"metric": "eval_loss", "mode": "min", "margin": 0.01,
                                "missing_baseline": "promote"}


def test_newest_complete_snapshot_is_chosen(tmp_path):
    from posttrain.errors import DataError
    from posttrain.retrain import SnapshotConfig, newest_snapshot
    shutil.copytree(SNAPSHOTS, tmp_path, dirs_exist_ok=True)
    (tmp_path / "2026-12-31").mkdir()                      # incomplete: no files yet
    snap = newest_snapshot(SnapshotConfig(root=str(tmp_path)))
    assert snap["name"] == "2026-11-30" and snap["train"].endswith("2026-11-30/train.jsonl")
    with pytest.raises(DataError, match="no snapshot under"):
        newest_snapshot(SnapshotConfig(root=str(tmp_path / "2026-12-31")))


@pytest.mark.slow
def test_gate_promotes_refuses_a_worse_model_and_moves_the_tag_to_a_better_one(
        sandbox, monkeypatch, tmp_path):
    from metaflow import Run, Runner
    monkeypatch.setenv("USER", sandbox.env["USER"])
    snapshots = tmp_path / "snapshots"
    shutil.copytree(SNAPSHOTS / "2026-11-29", snapshots / "2026-11-29")

    def configure(steps: int, **changes) -> Path:
        recipe = sandbox.config(REPO / "configs/sft/arithmetic_tiny.yaml", name="recipe.yaml",
                                **{"train.max_steps": steps, "eval.max_batches": 4,
                                   "train.scheduler.warmup_steps": 1, **changes})
        config = tmp_path / "retrain.yaml"
        config.write_text(yaml.safe_dump({
            "recipe": str(recipe), "snapshots": {"root": str(snapshots)},
            "gate": {"metric": "eval_loss", "mode": "min", "margin": 0.01}}))
        return config

    def launch(steps: int) -> Run:
        config = configure(steps)
        with Runner(str(RETRAIN_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                    config=[("config", str(config))], pylint=False) as runner:
            run = runner.run().run
            assert run.successful, run
            return Run(run.pathspec)

    first = launch(4)
    d1 = first.data.decision
    assert d1["promote"] and d1["baseline_run"] is None
    assert d1["reason"].startswith("no promoted model yet")
    assert first.data.snapshot["name"] == "2026-11-29"
    assert "promoted" in first.tags
    assert first.data.lineage["datasets"][0]["content_hash"] == \
        first["prepare"].task.data.content_hash

    shutil.copytree(SNAPSHOTS / "2026-11-30", snapshots / "2026-11-30")   # new data arrives
    second = launch(2)
    d2 = second.data.decision
    print(f"gate: 4-step baseline eval loss {d2['baseline']:.4f}, 2-step candidate "
          f"{d2['candidate']:.4f} (margin {0.01})")
    assert second.data.snapshot["name"] == "2026-11-30"
    assert d2["baseline_run"] == first.pathspec
    assert not d2["promote"] and d2["candidate"] > d2["baseline"]
    assert "worse by" in d2["reason"] and d2["reason"].endswith("not promoted")
    assert "promoted" not in Run(second.pathspec).tags
    assert "promoted" in Run(first.pathspec).tags            # the tag stayed
    card = get_card(sandbox, RETRAIN_FLOW, f"{second.id}/evaluate", "promotion")
    assert any("not promoted" in str(c) for c in card)

    # a better recipe, its run killed mid-training and resumed
    config = configure(8, **{"train.checkpoint_every_steps": 4})
    origin_id = run_and_kill(sandbox, RETRAIN_FLOW, {"config": config}, "RetrainFlow",
                             "train", 4)
    resumed, out = resume(sandbox, RETRAIN_FLOW)
    assert resumed.successful, out[-3000:]
    third = Run(resumed.pathspec)
    assert third["prepare"].task.origin_pathspec.startswith(f"RetrainFlow/{origin_id}/")
    result = third["train"].task.data.train_result
    assert (result["started_at_step"], result["steps"]) == (4, 8)
    assert third.data.lineage["resumed_from"] == f"RetrainFlow/{origin_id}"
    recipe = tmp_path / "trained_recipe.yaml"
    recipe.write_text(yaml.safe_dump(third.data.recipe))
    assert safetensors(third.data.hf_uri) == \
        safetensors(reference_export(sandbox, "train_sft", recipe))
    d3 = third.data.decision
    print(f"gate: 4-step baseline eval loss {d3['baseline']:.4f}, 8-step candidate "
          f"{d3['candidate']:.4f}")
    assert d3["promote"] and d3["baseline_run"] == first.pathspec
    assert d3["candidate"] < d3["baseline"] - 0.01
    assert "promoted" in Run(third.pathspec).tags
    assert "promoted" not in Run(first.pathspec).tags           # the tag moved
    assert "promoted" not in Run(f"RetrainFlow/{origin_id}").tags
