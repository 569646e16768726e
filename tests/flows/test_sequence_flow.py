"""The event-sequence flow through Metaflow's Runner API on the bundled synthetic events:
start -> prepare (event vocabulary, head labels) -> train (inline worker) -> join -> evaluate
(held-out next item and heads) -> end (lineage); and its config check."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from .conftest import REPO, get_card

SEQUENCE_FLOW = REPO / "flows" / "sequence_flow.py"
TINY_SEQUENCE = REPO / "configs" / "sequence" / "tiny.yaml"
SCHEMA = "posttrain.train.sequence.SequenceConfig"
# a few steps and a short evaluation: the recipe's learning is proved in
# tests/steps/test_train_sequence.py; here, that the flow runs it and keeps its outputs
QUICK = {"train.max_steps": 6, "train.checkpoint_every_steps": 3, "eval.max_batches": 4}


def _parse():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    return parse_config(SCHEMA)


def test_config_files_pass_the_schema():
    for path in sorted(TINY_SEQUENCE.parent.glob("*.yaml")):
        resolved = _parse()(path.read_text())
        assert resolved["data"]["format"] == "sequence", path


def test_wrong_pad_id_fails_in_the_parser():
    from metaflow.exception import MetaflowException
    data = yaml.safe_load(TINY_SEQUENCE.read_text())
    data["train"]["loader"]["packing"]["pad_token_id"] = 7
    with pytest.raises(MetaflowException, match="pad_token_id"):
        _parse()(yaml.safe_dump(data))


def test_code_package_ships_the_recipe_and_its_data(sandbox):
    """What a remote task needs: the recipe, its config and the bundled event data."""
    import os
    import subprocess
    listed = subprocess.run([sys.executable, str(SEQUENCE_FLOW), "package", "list"], cwd=REPO,
                            env={**os.environ, **sandbox.env}, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    for rel in ("flows/_posttrain_flow.py", "steps/train_sequence.py",
                "lib/posttrain/train/sequence.py", "lib/posttrain/data/events.py",
                "configs/sequence/tiny.yaml", "assets/data/events/train.jsonl"):
        assert str(REPO / rel) in listed.stdout + listed.stderr, rel


@pytest.mark.slow
def test_sequence_flow_end_to_end(sandbox, monkeypatch):
    from metaflow import Run, Runner
    from transformers import AutoModelForCausalLM

    from posttrain.models.heads import load_heads
    monkeypatch.setenv("USER", sandbox.env["USER"])      # the client in this process reads it
    config = sandbox.config(TINY_SEQUENCE, **QUICK)
    with Runner(str(SEQUENCE_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("config", str(config))], pylint=False) as runner:
        run = runner.run().run
    assert run.successful, run
    prepare, train, evaluate = run["prepare"].task, run["join"].task, run["evaluate"].task
    assert prepare.data.manifest_summary["format"] == "sequence"
    assert prepare.data.manifest_summary["totals"]["rows_written"] > 0
    result = train.data.train_result
    assert result["steps"] == 6 and result["started_at_step"] == 0
    assert train.data.checkpoint_uri.startswith(run["start"].task.data.storage_root)
    held = evaluate.data.heldout
    assert held == pytest.approx({k: v for k, v in result["eval"].items()
                                  if isinstance(v, (int, float))})
    assert 0.0 < held["eval_next_item_accuracy"] <= 1.0 and held["eval_tokens"] > 0
    published = json.loads(open(evaluate.data.eval_uri).read())
    assert published["metrics"] == held and published["model_uri"] == train.data.hf_uri
    assert published["provenance"]["content_hash"] == prepare.data.content_hash
    lineage = run["end"].task.data.lineage
    assert lineage["datasets"][0]["content_hash"] == prepare.data.content_hash
    assert lineage["outputs"]["hf_uri"] == train.data.hf_uri and lineage["resumed_from"] is None
    assert f"dataset:{prepare.data.content_hash[:12]}" in Run(run.pathspec).tags
    # the export: the next-item model for transformers, the heads beside it
    model = AutoModelForCausalLM.from_pretrained(train.data.hf_uri)
    assert model.config.num_hidden_layers == 2
    assert set(load_heads(train.data.hf_uri)) == {"event_type", "dwell"}
    card = get_card(sandbox, SEQUENCE_FLOW, f"{run.id}/evaluate", "evaluation")
    assert any(c["type"] == "table" for c in card)
