"""The distillation flow through Metaflow's Runner API on the tiny assets, and its config check."""

from __future__ import annotations

import sys

import pytest
import yaml

from .conftest import REPO, ray_processes_under

DISTILL_FLOW = REPO / "flows" / "distill_flow.py"
TINY_DISTILL = REPO / "configs" / "distill" / "tiny.yaml"
SCHEMA = "posttrain.train.distill.DistillConfig"
# a few steps of the tiny models on a slice of the data, two Ray workers
QUICK = {"train.max_steps": 6, "train.checkpoint_every_steps": 3, "eval.max_batches": 4,
         "train.tokens_per_step": 2048,
         "data.train": [{"name": "chat", "path": "assets/data/chat/train.jsonl"}],
         "data.eval": [{"name": "chat", "path": "assets/data/chat/eval.jsonl"}],
         "train.loader.epochs": 1}


def _parse():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    return parse_config(SCHEMA)


def test_tiny_config_passes_the_schema():
    resolved = _parse()(TINY_DISTILL.read_text())
    assert resolved["teacher"]["signal"] == "online" and resolved["run"]["num_workers"] == 2


def test_offline_teacher_with_mixer_weights_fails_in_the_parser():
    from metaflow.exception import MetaflowException
    data = yaml.safe_load(TINY_DISTILL.read_text())
    data["teacher"]["signal"] = "offline"
    data["train"]["loader"]["weights"] = {"chat": 1.0}
    with pytest.raises(MetaflowException, match="train.loader.weights"):
        _parse()(yaml.safe_dump(data))


@pytest.mark.slow
def test_distill_flow_end_to_end(sandbox, monkeypatch):
    """start -> prepare -> distill (local Ray, 2 workers) -> join -> evaluate -> end."""
    from metaflow import Runner
    monkeypatch.setenv("USER", sandbox.env["USER"])      # the client in this process reads it
    config = sandbox.config(base=TINY_DISTILL, **QUICK)
    with Runner(str(DISTILL_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("config", str(config))], pylint=False) as runner:
        run = runner.run().run
        assert run.successful, run
        distill, evaluate = run["join"].task, run["evaluate"].task
        assert distill.data.distill_result["steps"] == 6
        assert distill.data.distill_result["model"]["world_size"] == 2
        assert distill.data.distill_result["model"]["teacher_params"] > \
            distill.data.distill_result["model"]["params"]
        assert distill.data.checkpoint_uri.startswith(run["start"].task.data.storage_root)
        assert evaluate.data.kl_after < evaluate.data.kl_before
        assert evaluate.data.eval_loss > 0
        print(f"flow: held-out KL {evaluate.data.kl_before:.4f} -> {evaluate.data.kl_after:.4f}")
    assert not ray_processes_under(sandbox.ray_tmpdir)
