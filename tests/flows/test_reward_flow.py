"""The reward-model flow through Metaflow's Runner API on the tiny assets: start -> prepare ->
train (Ray, two workers) -> join -> evaluate (held-out pairs scored by the exported model)."""

from __future__ import annotations

import pytest

from .conftest import REPO, ray_processes_under

REWARD_FLOW = REPO / "flows" / "reward_flow.py"
TINY_REWARD = REPO / "configs" / "reward" / "tiny.yaml"


@pytest.mark.slow
def test_reward_flow_end_to_end_local(sandbox, monkeypatch):
    from metaflow import Runner

    from posttrain.models.reward_model import load_reward_model
    monkeypatch.setenv("USER", sandbox.env["USER"])      # the client reads the run here
    config = sandbox.config(TINY_REWARD, **{
        "train.max_steps": 24, "train.checkpoint_every_steps": 12, "eval.max_batches": 8})
    with Runner(str(REWARD_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("config", str(config))], pylint=False) as runner:
        run = runner.run().run
        assert run.successful, run
        prepare, train, evaluate = run["prepare"].task, run["join"].task, run["evaluate"].task
        assert train.data.train_result["steps"] == 24
        assert train.data.train_result["model"]["world_size"] == 2
        held = evaluate.data.heldout
        assert held["pairs"] == 100 and held["accuracy"] > 0.6, held
        assert evaluate.data.eval_provenance["content_hash"] == prepare.data.content_hash
        model_uri = train.data.model_uri
    score = load_reward_model(model_uri)
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    assert isinstance(score(prompt, "2 + 2 = 4."), float)
    assert not ray_processes_under(sandbox.ray_tmpdir)
