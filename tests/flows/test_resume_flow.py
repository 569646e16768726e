"""`python flows/<x>_flow.py resume` after the whole run was killed mid-training, for every
flow that trains (the retraining flow's case is in test_retrain_flow.py, where the resumed run
is also the better candidate that takes the `promoted` tag).

The run's process group (the Metaflow runtime, its train task and the task's Ray cluster) is
SIGKILLed once the train step has committed checkpoint 2 (of 4 steps), so the run fails
without its @retry. `resume` then clones the steps before the train step (their
artifacts are reused: prepare, or the pipeline's SFT step, does not run again), reruns the
train step, which continues from the killed run's checkpoint 2 in the same storage root, and
exports weights byte-identical to an uninterrupted run's; the lineage of the resumed run names
its origin.

The uninterrupted run is the recipe's own driver (`python -m steps.<recipe>`, which the
flow's train step calls through `train_recipe`) on the same config, not a second flow run: the
same bytes (an uninterrupted DPO and sequence flow run exported exactly the driver's; SFT's
and GRPO's, compared flow to flow before) for a fraction of the time. Every case trains inline
on one worker: a case takes 15-40 s on two cores. The Ray launcher's resume inside a flow is
test_sft_flow.py's killed train attempt (two Ray workers continue from its checkpoint under
@retry), and its bit-identical multi-worker resume is tests/steps'; on two Ray workers here,
the SFT case took 88-95 s in the suite for what those two already check.
The start step's memory plan is off (`run.plan_check: off`), as in every flow test but the SFT
flow's (`FlowSandbox.config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import (ARITHMETIC_SFT, GRPO_FLOW, REPO, SFT_FLOW, TINY_GRPO, TINY_SFT,
                       ray_processes_under, reference_export, resume, run_and_kill,
                       safetensors)

pytestmark = pytest.mark.slow
INLINE = {"run.launcher": "inline", "run.num_workers": 1}
FOUR_STEPS = {"train.max_steps": 4, "train.checkpoint_every_steps": 2}
ARITHMETIC_MODEL = str(REPO / "tests/fixtures/arithmetic_sft")
SHORT_GRPO = {**FOUR_STEPS, "train.prompts_per_step": 4, "train.samples_per_prompt": 4,
              "train.mini_batches": 1, "eval.max_prompts": 4, "eval.num_records": 2}


@dataclass
class Case:
    flow_file: Path
    flow: str                     # the flow class
    recipe: str                   # steps.<recipe>: the driver its train step runs
    configs: dict[str, tuple[Path, dict]]     # Config name -> (base YAML, changes)
    trained: str = "config"       # the Config the train step trains
    train_step: str = "train"     # the step that trains (and checkpoints)
    checkpoints: str = "train"    # its checkpoints: <storage root>/<this>/checkpoints
    result: tuple[str, str] = ("join", "train_result")   # (step, artifact) of the summary
    export: tuple[str, str] = ("join", "hf_uri")          # (step, artifact) of the export
    start_from: tuple[str, str] | None = None  # (step, artifact): the model it started from
    steps: int = 4


def _flow(name: str) -> Path:
    return REPO / "flows" / f"{name}_flow.py"


def _config(name: str) -> Path:
    return REPO / "configs" / name / "tiny.yaml"


CASES = {
    "sft": Case(SFT_FLOW, "SFTFlow", "train_sft", {"config": (TINY_SFT, {
        **INLINE, **FOUR_STEPS, "eval.max_batches": 2,
        "eval.generate": {"num_samples": 1, "max_new_tokens": 4}})}),
    "dpo": Case(_flow("dpo"), "DPOFlow", "train_dpo", {"config": (_config("dpo"), {
        **INLINE, **FOUR_STEPS, "eval.max_batches": 2})}),
    "reward": Case(_flow("reward"), "RewardFlow", "train_reward", {"config": (
        _config("reward"), {**INLINE, **FOUR_STEPS, "eval.max_batches": 2})},
        export=("join", "model_uri")),
    "distill": Case(_flow("distill"), "DistillFlow", "train_distill", {"config": (
        _config("distill"), {
            **INLINE, **FOUR_STEPS, "eval.max_batches": 2, "train.tokens_per_step": 2048,
            "data.train": [{"name": "chat", "path": "assets/data/chat/train.jsonl"}],
            "data.eval": [{"name": "chat", "path": "assets/data/chat/eval.jsonl"}],
            "train.loader.epochs": 1})},
        train_step="distill", checkpoints="distill", result=("join", "distill_result")),
    "sequence": Case(_flow("sequence"), "SequenceFlow", "train_sequence", {"config": (
        _config("sequence"), {**FOUR_STEPS, "eval.max_batches": 2})}),
    "grpo": Case(GRPO_FLOW, "GRPOFlow", "train_grpo", {"config": (TINY_GRPO, {
        "model.hf_dir": ARITHMETIC_MODEL, **SHORT_GRPO})},
        train_step="grpo", checkpoints="grpo"),
    # the pipeline's GRPO step is killed: its SFT step (trained before) is cloned, and GRPO
    # continues from the SFT export of the killed run
    "pipeline": Case(_flow("pipeline"), "PipelineFlow", "train_grpo", {
        "sft": (ARITHMETIC_SFT, {"train.max_steps": 4, "eval.max_batches": 1,
                                 "eval.generate": {"num_samples": 1, "max_new_tokens": 4}}),
        "grpo": (TINY_GRPO, SHORT_GRPO),
        "suite": (REPO / "configs/eval/tiny.yaml", {})},
        trained="grpo", train_step="train_grpo", checkpoints="grpo/train",
        result=("train_grpo", "grpo_result"), export=("train_grpo", "hf_uri"),
        start_from=("train_sft", "sft_hf_uri")),
}


def _suite(sandbox) -> Path:
    """The pipeline's evaluation: one held-out loss task on a few rows (its GRPO is tested)."""
    import yaml
    suite = yaml.safe_load((REPO / "configs/eval/tiny.yaml").read_text())
    suite["tasks"] = [dict(t, max_samples=4) for t in suite["tasks"]
                      if t["name"] == "arithmetic_worked_loss"]
    path = sandbox.root / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_continues_a_killed_run_from_its_checkpoint(sandbox, monkeypatch, name):
    from metaflow import Run
    case = CASES[name]
    monkeypatch.setenv("USER", sandbox.env["USER"])
    configs = {key: _suite(sandbox) if key == "suite" else
               sandbox.config(base, name=f"{key}.yaml", **changes)
               for key, (base, changes) in case.configs.items()}

    origin_id = run_and_kill(sandbox, case.flow_file, configs, case.flow, case.checkpoints, 2)
    origin = Run(f"{case.flow}/{origin_id}", _namespace_check=False,
                 _current_metadata=f"local@{sandbox.root / 'mfroot'}")
    assert not origin.successful

    resumed, out = resume(sandbox, case.flow_file)
    assert resumed.successful and resumed.id != origin.id, out[-3000:]
    # the steps before the train step were cloned from the origin: its storage root, its
    # prepared data (the pipeline: its SFT export)
    steps = [s.id for s in resumed]                     # newest first
    for step in steps[steps.index(case.train_step) + 1:]:
        assert resumed[step].task.origin_pathspec.startswith(origin.pathspec + "/"), step
    assert resumed["start"].task.data.storage_root == origin["start"].task.data.storage_root
    assert resumed[case.train_step].task.origin_pathspec is None      # this one ran again
    step, artifact = case.result
    result = getattr(resumed[step].task.data, artifact)
    assert (result["started_at_step"], result["steps"]) == (2, case.steps)
    assert resumed["end"].task.data.lineage["resumed_from"] == origin.pathspec

    sets = {}
    if case.start_from:
        step, artifact = case.start_from
        sets = {"model.hf_dir": getattr(resumed[step].task.data, artifact), "model.init": "null"}
    reference = reference_export(sandbox, case.recipe, configs[case.trained], sets)
    step, artifact = case.export
    assert safetensors(getattr(resumed[step].task.data, artifact)) == safetensors(reference)
    assert not ray_processes_under(sandbox.ray_tmpdir)
