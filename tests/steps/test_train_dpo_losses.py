"""The preference recipe's other losses, run from their bundled configs as a user runs them:
SimPO and ORPO (reference-free, on pairs) and KTO (on unpaired, labelled completions).

Each loss equals its paper formula on random tensors in tests/lib/losses/test_{simpo,orpo,
kto}.py; here each `configs/dpo/<loss>_tiny.yaml` runs on one inline worker over the first 200
pairs (KTO: 400 completions) and 40 held-out pairs (80 completions), 12 steps:
- the first 10 losses are golden values (tests/golden/dpo_<loss>.json);
- the run raises held-out preference accuracy, in training (the loss's own accuracy on the
  held-out split) and in the evaluate step's suite: the export against the starting model on
  held-out pairs (KTO: the pairs of `eval.pairs`);
- a run SIGKILLed after a checkpoint and restarted with the CLI ends with bit-identical
  exported weights and per-step metrics;
- SimPO and ORPO run no reference pass (no reference log-probs on disk); KTO's first loss is
  1/2 (policy = reference, z_0 = 0) and each step's z_0 is max(0, the previous step's mean
  log-ratio), across the restart too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.config.loader import build
from posttrain.errors import ConfigError
from posttrain.train.dpo import DPOConfig
from steps import evaluate, train_dpo

from .conftest import run_and_kill, safetensors, step_metrics
from .golden import check_golden

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

LOSSES = ("simpo", "orpo", "kto")
TRAIN_PAIRS, EVAL_PAIRS = 200, 40
MAX_STEPS, KILL_STEP = 12, 6
# Learning thresholds: below the smallest value measured over ATEN_CPU_CAPABILITY default /
# avx2 x 1 / 2 threads (the table in docs/tests.md). `eval` is the run's own
# held-out accuracy; `suite` the evaluate step's reward accuracy of the export against the
# start (which ties with itself: 0), and `logp` its reference-free accuracy gain over the start.
# Measured (the same to 3 decimals under every setting): SimPO 0.825 / 0.825 / +0.275, ORPO
# 0.775 / 0.750 / +0.225, KTO 0.688 / 0.825 / +0.125 (KTO's log-probs are sums, which favour
# the shorter rejected responses: 0.30 -> 0.425).
MIN = {"simpo": {"eval": 0.7, "suite": 0.7, "logp": 0.15},
       "orpo": {"eval": 0.65, "suite": 0.65, "logp": 0.1},
       "kto": {"eval": 0.6, "suite": 0.7, "logp": 0.05}}


def small_config(tmp: Path, name: str) -> Path:
    """The bundled config on one inline worker, its data cut to the first rows."""
    cfg = yaml.safe_load((ROOT / "configs" / "dpo" / f"{name}_tiny.yaml").read_text())
    per_pair = 2 if name == "kto" else 1
    sources = [(s, "train", TRAIN_PAIRS * per_pair) for s in cfg["data"]["train"]] + \
              [(s, "eval", EVAL_PAIRS * per_pair) for s in cfg["data"]["eval"]] + \
              [(s, "pairs", EVAL_PAIRS) for s in cfg["eval"].get("pairs", [])]
    for source, split, rows in sources:
        lines = (ROOT / source["path"]).read_text().splitlines()[:rows]
        source["path"] = str(tmp / f"{split}.jsonl")
        Path(source["path"]).write_text("\n".join(lines) + "\n")
    cfg["run"].update(num_workers=1, launcher="inline")
    cfg["train"].update(max_steps=MAX_STEPS, checkpoint_every_steps=3, keep_checkpoints=10)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / f"{name}.yaml"


@pytest.mark.parametrize("name", LOSSES)
def test_bundled_config_golden_learns_and_resumes(name, tmp_path):
    config = small_config(tmp_path, name)
    ref_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    result = train_dpo.run(config, overrides={"run.dir": str(ref_dir)}, show_progress=False)
    ref = step_metrics(ref_dir)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))
    check_golden(f"dpo_{name}", [ref[s]["loss"] for s in sorted(ref)])

    if name == "kto":
        assert ref[1]["loss"] == pytest.approx(0.5, abs=1e-7) and ref[1]["kl"] == 0
        for s in range(2, MAX_STEPS + 1):
            assert ref[s]["kl"] == max(0.0, ref[s - 1]["log_ratio"]), s
        assert ref[MAX_STEPS]["kl"] > 0 and result["eval"]["eval_completions"] == 2 * EVAL_PAIRS
        assert (ref_dir / "reference" / "ref_logps_train.parquet").is_file()
        _kto_with_lora_base_reference(config, ref_dir)
    else:
        assert not (ref_dir / "reference").exists()          # reference-free: no pass
        assert result["eval"]["eval_pairs"] == EVAL_PAIRS

    # the learning effect: held-out preference accuracy, in training and by the evaluate
    # step's suite (the export against the starting model, which it runs as its reference)
    ev = result["eval"]
    suite = evaluate.recipe_suite("dpo", config)
    (task,) = evaluate.run(suite, result["hf_dir"], result["base_model_dir"]).tasks
    gain = task.model["logp_accuracy"] - task.baseline["logp_accuracy"]
    print(f"{name}: held-out accuracy {ev['eval_accuracy']:.3f}, margin {ev['eval_margins']:.4f};"
          f" suite reward accuracy {task.model['reward_accuracy']:.3f}, log-prob accuracy "
          f"{task.baseline['logp_accuracy']:.3f} -> {task.model['logp_accuracy']:.3f}")
    assert task.num_samples == EVAL_PAIRS and task.baseline["reward_accuracy"] == 0
    assert ev["eval_accuracy"] > MIN[name]["eval"] and ev["eval_margins"] > 0
    assert task.model["reward_accuracy"] > MIN[name]["suite"]
    assert gain > MIN[name]["logp"]

    run_and_kill("steps.train_dpo", config, killed_dir, KILL_STEP)
    resumed = train_dpo.run(config, overrides={"run.dir": str(killed_dir)},
                            show_progress=False)
    assert (resumed["started_at_step"], resumed["steps"]) == (KILL_STEP, MAX_STEPS)
    assert safetensors(killed_dir / "hf") == safetensors(ref_dir / "hf")
    got = step_metrics(killed_dir)
    keys = ("loss", "grad_norm", "accuracy", "margins") + (("kl",) if name == "kto" else ())
    for step in ref:
        assert [got[step][k] for k in keys] == [ref[step][k] for k in keys], step
    assert resumed["eval"] == result["eval"]


def _kto_with_lora_base_reference(config: Path, ref_dir: Path) -> None:
    """KTO with LoRA and the base model as its reference (adapters disabled, inside the step):
    the first step sits at the reference, loss 1/2, then it moves."""
    from posttrain.config.loader import to_dict
    from posttrain.config.recipes import load_recipe
    from posttrain.train.dpo import DPO
    from posttrain.train.recipe import RecipeWorker
    cfg = to_dict(load_recipe(config, DPOConfig, {
        "model.lora": {"rank": 4, "alpha": 8.0}, "export.format": "peft",
        "reference.kind": "lora_base", "run.dir": str(ref_dir.parent / "lora")}))
    worker = RecipeWorker(DPO, cfg, str(ref_dir / "base_model"), str(ref_dir / "prepared"),
                          str(ref_dir.parent / "lora"))
    try:
        assert worker.before_training() == {}
        first, second = worker.train_step(), worker.train_step()
    finally:
        worker.close()
    assert first["loss"] == pytest.approx(0.5, abs=1e-7) and first["log_ratio"] == 0
    assert second["loss"] != first["loss"] and second["log_ratio"] != 0


def _bundled(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / "dpo" / f"{name}_tiny.yaml").read_text())


@pytest.mark.parametrize("name, change, message", [
    ("kto", {"data.format": "preference"}, "KTO trains on unpaired"),
    ("kto", {"train.loader.format": "preference"}, "train.loader.format: unpaired"),
    ("kto", {"train.loader.packing.max_tokens_per_pack": 64}, "must hold a whole completion"),
    ("kto", {"loss.gamma_beta_ratio": 0.5}, "gamma_beta_ratio applies to loss_type simpo"),
    ("kto", {"loss.desirable_weight": 0.0}, "desirable_weight must be positive"),
    ("simpo", {"reference": {"kind": "lora_base"}}, "simpo is reference-free"),
    ("simpo", {"eval.pairs": [{"path": "x.jsonl"}]}, "eval.pairs is for loss_type kto"),
    ("simpo", {"loss.gamma_beta_ratio": -1.0}, "gamma_beta_ratio must be >= 0"),
    ("simpo", {"data.format": "unpaired"}, "DPO trains on preference data"),
    ("orpo", {"loss.label_smoothing": 0.1}, "sigmoid, robust and simpo, not orpo"),
    ("orpo", {"loss.logp_reduction": "sum"}, "does not suit orpo"),
    ("orpo", {"loss.desirable_weight": 1.0}, "desirable_weight applies to loss_type kto"),
    ("orpo", {"loss.loss_type": "kpo"}, "loss.loss_type: 'kpo' is not one of"),
])
def test_bad_configs_name_the_key(name, change, message):
    cfg = _bundled(name)
    for dotted, value in change.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    with pytest.raises((ConfigError, ValueError), match=message):
        build(DPOConfig, cfg)
