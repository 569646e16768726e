"""The local chain SFT -> GRPO -> evaluation in one Metaflow run (flows/pipeline_flow.py):
every link is an artifact of the run, GRPO starts from the SFT export, and the evaluation
compares the GRPO model with exactly that SFT model."""

from __future__ import annotations

import pytest
import yaml

from .conftest import REPO, get_card

PIPELINE_FLOW = REPO / "flows" / "pipeline_flow.py"


@pytest.mark.slow
def test_sft_grpo_eval_chain_in_one_run(sandbox, monkeypatch):
    from metaflow import Runner
    from safetensors.torch import load_file
    monkeypatch.setenv("USER", sandbox.env["USER"])
    sft = sandbox.config(REPO / "configs/sft/arithmetic_tiny.yaml", name="sft.yaml", **{
        "train.max_steps": 20, "eval.max_batches": 2, "eval.generate.num_samples": 1})
    grpo = sandbox.config(REPO / "configs/grpo/tiny.yaml", name="grpo.yaml", **{
        "train.max_steps": 2, "train.prompts_per_step": 4, "eval.max_prompts": 8})
    suite = yaml.safe_load((REPO / "configs/eval/tiny.yaml").read_text())
    suite["tasks"] = [dict(t, max_samples=8) for t in suite["tasks"]
                      if t["name"] in ("arithmetic_worked_loss", "arithmetic_answer")]
    suite_path = sandbox.root / "suite.yaml"
    suite_path.write_text(yaml.safe_dump(suite))
    with Runner(str(PIPELINE_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("sft", str(sft)), ("grpo", str(grpo)), ("suite", str(suite_path))],
                pylint=False) as runner:
        run = runner.run().run
        assert run.successful, run
        end = run["end"].task.data
        assert end.sft_result["steps"] == 20 and end.grpo_result["steps"] == 2
        assert end.grpo_result["max_sync_diff"] <= 1e-5
        # GRPO started from the SFT export: its step-0 evaluation is the SFT model's
        assert end.grpo_result["baseline_eval"]["eval/num_prompts"] == 8
        table = {(r["task"], r["metric"]): r for r in end.eval_table}
        loss = table[("arithmetic_worked_loss", "loss")]
        assert loss["delta"] == pytest.approx(loss["model"] - loss["baseline"], abs=1e-12)
        assert abs(loss["delta"]) < 0.05          # two small GRPO steps move the model little
        # the GRPO export has the SFT model's architecture (it was trained from it)
        sft_w = load_file(f"{end.sft_hf_uri}/model.safetensors")
        grpo_w = load_file(f"{end.hf_uri}/model.safetensors")
        assert {k: v.shape for k, v in sft_w.items()} == {k: v.shape for k, v in grpo_w.items()}
        lineage = end.lineage
        assert {d["content_hash"] for d in lineage["datasets"]} == \
            {end.sft_content_hash, end.grpo_content_hash}
        assert lineage["outputs"]["hf_uri"] == end.hf_uri
    from metaflow import Run
    tags = Run(run.pathspec).tags
    assert {f"dataset:{end.sft_content_hash[:12]}", f"dataset:{end.grpo_content_hash[:12]}"} <= tags
    card = get_card(sandbox, PIPELINE_FLOW, f"{run.id}/evaluate", "evaluation")
    assert any(c["type"] == "vegaChart" for c in card)
