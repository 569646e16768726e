"""The DPO flow through Metaflow's Runner API on the tiny assets: start -> prepare -> train
(Ray, two workers) -> join -> evaluate (held-out preference accuracy vs the starting model)."""

from __future__ import annotations

import sys

import pytest
import yaml

from .conftest import REPO, ray_processes_under

DPO_FLOW = REPO / "flows" / "dpo_flow.py"
TINY_DPO = REPO / "configs" / "dpo" / "tiny.yaml"


def test_config_files_pass_the_schema():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    parse = parse_config("posttrain.train.dpo.DPOConfig")
    resolved = parse(TINY_DPO.read_text())
    assert resolved["reference"]["kind"] == "precomputed"
    reward = parse_config("posttrain.train.reward.RewardConfig")
    assert reward((REPO / "configs/reward/tiny.yaml").read_text())["data"]["format"] == \
        "preference"


def test_unknown_key_fails_in_the_parser():
    from metaflow.exception import MetaflowException
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    data = yaml.safe_load(TINY_DPO.read_text())
    data["loss"]["betta"] = 0.2
    with pytest.raises(MetaflowException, match="betta"):
        parse_config("posttrain.train.dpo.DPOConfig")(yaml.safe_dump(data))


@pytest.mark.slow
def test_dpo_flow_end_to_end_local(sandbox, monkeypatch):
    from metaflow import Runner
    monkeypatch.setenv("USER", sandbox.env["USER"])      # the client reads the run here
    from transformers import AutoModelForCausalLM
    config = sandbox.config(TINY_DPO, **{
        "train.max_steps": 6, "train.checkpoint_every_steps": 3, "eval.max_batches": 8,
        "train.optimizer.lr": 0.003})
    with Runner(str(DPO_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("config", str(config))], pylint=False) as runner:
        run = runner.run().run
        assert run.successful, run
        prepare, train, evaluate = run["prepare"].task, run["join"].task, run["evaluate"].task
        assert prepare.data.manifest_summary["format"] == "preference"
        result = train.data.train_result
        assert result["steps"] == 6 and result["model"]["world_size"] == 2
        assert result["reference_pairs"]["train"] == 1000
        held = evaluate.data.heldout          # the export against the starting model
        assert held["reward_accuracy"] > 0.5 and held["reward_margin"] > 0
        table = {r["metric"]: r for r in evaluate.data.eval_table}
        assert table["reward_accuracy"]["model"] == held["reward_accuracy"]
        assert table["reward_accuracy"]["baseline"] == 0          # the start against itself
        assert evaluate.data.eval_provenance["content_hash"] == prepare.data.content_hash
        hf_uri = train.data.hf_uri
    model = AutoModelForCausalLM.from_pretrained(hf_uri)
    assert model.config.num_hidden_layers == 4
    assert not ray_processes_under(sandbox.ray_tmpdir)
