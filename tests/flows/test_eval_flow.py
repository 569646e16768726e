"""The eval flow through Metaflow's Runner API, on an SFT run found by pathspec:

    SFTFlow (arithmetic chats, a few steps) -> EvalFlow --model-run SFTFlow/<id>
    --baseline-dir <the random model that SFT run started from>:
    start (resolves both checkpoints) -> evaluate (every task kind; table, records, JSON, card)
    -> end
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from .conftest import REPO, get_card

EVAL_FLOW = REPO / "flows" / "eval_flow.py"
TINY_SUITE = REPO / "configs" / "eval" / "tiny.yaml"
SUITE_SCHEMA = "posttrain.eval.suites.SuiteConfig"


def _parse_config():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    return parse_config(SUITE_SCHEMA)


def test_bundled_suite_passes_the_schema_and_a_typo_fails_at_launch():
    from metaflow.exception import MetaflowException
    resolved = _parse_config()(TINY_SUITE.read_text())
    assert [t["kind"] for t in resolved["tasks"]][:2] == ["heldout_loss", "heldout_loss"]
    assert resolved["rollout"]["kind"] == "native"
    data = yaml.safe_load(TINY_SUITE.read_text())
    data["tasks"][2]["grader"]["knd"] = "regex"
    with pytest.raises(MetaflowException, match=r"tasks\[2\]\.grader\.knd: unknown key"):
        _parse_config()(yaml.safe_dump(data))


def test_a_checkpoint_is_named_once():
    sys.path.insert(0, str(REPO / "flows"))
    from _flow_runs import resolve_checkpoint
    assert resolve_checkpoint("model", "", "/some/dir") == ("/some/dir", None)
    for run, directory in (("", ""), ("SFTFlow/1", "/some/dir")):
        with pytest.raises(ValueError, match="exactly one of --model-run .* and --model-dir"):
            resolve_checkpoint("model", run, directory)


def _small_suite(path) -> None:
    """The bundled suite on fewer rows (the flow, not the metrics, is under test here)."""
    data = yaml.safe_load(TINY_SUITE.read_text())
    for task in data["tasks"]:
        task["max_samples"] = 12
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.slow
def test_eval_flow_compares_an_sft_run_with_its_starting_model(arithmetic_chain, monkeypatch):
    """EvalFlow on the chain's SFT run (tests/flows/conftest.py: 20 steps on worked
    arithmetic) against the random model that run started from."""
    from metaflow import Runner
    sandbox, sft = arithmetic_chain.sandbox, arithmetic_chain.sft
    monkeypatch.setenv("USER", sandbox.env["USER"])
    sft_pathspec, sft_hf = sft.pathspec, sft.data.hf_uri
    # the random model the SFT run started from (model.init), kept in its run directory
    base_model = f"{sft['start'].task.data.storage_root}/train/base_model"
    suite = sandbox.root / "suite.yaml"
    _small_suite(suite)
    with Runner(str(EVAL_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("suite", str(suite))], pylint=False) as runner:
        run = runner.run(model_run=sft_pathspec, baseline_dir=base_model,
                         run_dir=str(sandbox.root / "runs")).run
        assert run.successful, run
        start, evaluate = run["start"].task, run["evaluate"].task
        assert (start.data.model_uri, start.data.model_parent) == (sft_hf, sft_pathspec)
        assert (start.data.baseline_uri, start.data.baseline_parent) == (base_model, None)

        result, table = evaluate.data.suite_result, evaluate.data.eval_table
        records = evaluate.data.records
        names = [t["name"] for t in yaml.safe_load(suite.read_text())["tasks"]]
        assert list(result["tasks"]) == list(records) == names
        assert result["model_run"] == sft_pathspec and result["table"] == table
        for row in table:
            task = result["tasks"][row["task"]]
            assert row["model"] == task["model"][row["metric"]]
            assert row["baseline"] == task["baseline"][row["metric"]]
            assert row["delta"] == pytest.approx(row["model"] - row["baseline"], abs=1e-12)
        for name in names:
            assert len(records[name]) == result["tasks"][name]["num_samples"] == 12
            assert "records" not in result["tasks"][name]       # they are their own artifact
        rows = {(r["task"], r["metric"]): r for r in table}
        # 20 SFT steps on worked arithmetic: its held-out loss is far below the random start's
        assert rows[("arithmetic_worked_loss", "loss")]["delta"] < -1.0
        published = json.loads(open(evaluate.data.eval_uri).read())
        assert published["table"] == table
        assert published["tasks"]["arithmetic_answer"]["records"] == records["arithmetic_answer"]

        components = get_card(sandbox, EVAL_FLOW, f"{run.id}/evaluate", "evaluation")
        charts = [c for c in components if c["type"] == "vegaChart"]
        tables = [c for c in components if c["type"] == "table"]
        assert len(charts) == 1
        assert json.dumps(charts[0]).count('"checkpoint"') >= 2
        assert "model vs baseline" in json.dumps(charts[0])
        assert len(tables) == 1 + len(names)                    # summary + one per task
        text = json.dumps(tables)
        assert "arithmetic_worked_loss" in text and "model_output" in text
