"""steps/train_dpo.py end to end on a tiny model (hidden 64, 2 layers) and the bundled pairs.

What is proved here, against one uninterrupted reference run (a subprocess, 1 inline worker,
precomputed reference log-probs, a checkpoint after every step):
- the first step, through the real engine path (reference pass, packed pairs, FSDP root), has
  policy = reference: loss log 2 exactly (sigmoid), zero margins; so has a LoRA run whose
  reference is the base model with its adapters disabled;
- a few steps raise the reward accuracy (train and held-out; the held-out numbers also from the
  exported checkpoint against the starting model, in a separate process);
- SIGKILL + restart gives bit-identical exported weights;
- packed pairs give the same DPO loss, accuracy, margins and log-probs as padded pairs (same
  model, same reference, same data).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.config.loader import build
from posttrain.errors import ConfigError
from posttrain.train.dpo import DPOConfig

from functools import partial

from .conftest import run_and_kill, run_to_end, tiny_recipe
from .golden import check_golden

_run_to_end = partial(run_to_end, "steps.train_dpo")
_run_and_kill = partial(run_and_kill, "steps.train_dpo")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains the reference runs
TRAIN_PAIRS, EVAL_PAIRS = 200, 40
MAX_STEPS = 12
KILL_STEP = 5

CONFIG = {
    **tiny_recipe("preference", 96),
    "train": {"max_steps": MAX_STEPS, "tokens_per_step": 1024,  # 4 micro-batches of 1 x 256
              "loader": {"format": "preference",
                         "packing": {"max_tokens_per_pack": 256, "buffer_samples": 16},
                         "rows_per_batch": 1, "shuffle_buffer_samples": 32, "seed": 0,
                         "epochs": 2},
              "optimizer": {"lr": 0.003, "weight_decay": 0.0, "betas": [0.9, 0.95]},
              "scheduler": {"kind": "constant", "warmup_steps": 0},
              "grad_clip_norm": 1.0, "seed": 0,
              "checkpoint_every_steps": 1, "keep_checkpoints": 100},
    "loss": {"beta": 0.1, "loss_type": "sigmoid"},
    "eval": {"max_batches": 100},
}








def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    for split, rows in (("train", TRAIN_PAIRS), ("eval", EVAL_PAIRS)):
        lines = (ROOT / "assets/data/preference" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["run"]["dir"] = str(tmp / "unused")
    cfg["data"]["train"] = [{"name": "pairs", "path": str(tmp / "train.jsonl")}]
    cfg["data"]["eval"] = [{"name": "pairs", "path": str(tmp / "eval.jsonl")}]
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ref_dir = tmp / "reference"
    _run_to_end(config, ref_dir)
    return tmp, config, ref_dir


def test_first_losses_match_the_golden_values(tiny):
    metrics = _metrics(tiny[2])
    check_golden("dpo", [metrics[s]["loss"] for s in sorted(metrics)])


def test_first_step_is_log_2_and_accuracy_rises(tiny):
    tmp, config, ref_dir = tiny
    metrics = _metrics(ref_dir)
    assert sorted(metrics) == list(range(1, MAX_STEPS + 1))
    first = metrics[1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["margins"] == pytest.approx(0, abs=1e-5) and first["accuracy"] == 0
    assert first["logps_chosen"] < 0 and first["pairs"] > 4
    late = [metrics[s]["accuracy"] for s in range(MAX_STEPS - 5, MAX_STEPS + 1)]
    result = json.loads((ref_dir / "result.json").read_text())
    ev = result["eval"]
    print(f"DPO: train accuracy over the last 6 steps {sum(late) / len(late):.3f}, final loss "
          f"{metrics[MAX_STEPS]['loss']:.4f}; held-out accuracy {ev['eval_accuracy']:.3f}, "
          f"loss {ev['eval_loss']:.4f}, margin {ev['eval_margins']:.4f}")
    assert sum(late) / len(late) > 0.65, late           # from 0 (ties) at step 1
    assert metrics[MAX_STEPS]["loss"] < 0.6
    assert ev["eval_pairs"] == EVAL_PAIRS and ev["eval_accuracy"] > 0.7
    assert ev["eval_margins"] > 0 and ev["eval_loss"] < math.log(2)
    # the exported policy against the starting model: the DPO suite, in a separate process,
    # as a user runs it; the same pairs, so the in-training numbers are reproduced
    out_json = tmp / "eval.json"
    out = subprocess.run(
        [sys.executable, "-m", "steps.evaluate", "--recipe", "dpo", "--config", str(config),
         "--model", result["hf_dir"], "--baseline", result["base_model_dir"],
         "--out", str(out_json)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    task = next(iter(json.loads(out_json.read_text())["tasks"].values()))
    assert task["num_samples"] == EVAL_PAIRS
    assert task["model"]["reward_accuracy"] == pytest.approx(ev["eval_accuracy"], abs=1e-6)
    assert task["model"]["reward_margin"] == pytest.approx(ev["eval_margins"], rel=1e-3,
                                                           abs=1e-4)
    assert task["baseline"]["reward_accuracy"] == 0         # the start against itself: ties


def test_sigkill_and_resume_give_identical_weights(tiny):
    tmp, config, ref_dir = tiny
    run_dir = tmp / "killed"
    _run_and_kill(config, run_dir, KILL_STEP)
    ref_table = (run_dir / "reference" / "ref_logps_train.parquet").read_bytes()
    _run_to_end(config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["started_at_step"] == KILL_STEP
    assert (run_dir / "reference" / "ref_logps_train.parquet").read_bytes() == ref_table
    want = {p.name: p.read_bytes() for p in (ref_dir / "hf").glob("*.safetensors")}
    got = {p.name: p.read_bytes() for p in (run_dir / "hf").glob("*.safetensors")}
    assert want and got == want
    losses = _metrics(run_dir)
    assert [losses[s]["loss"] for s in sorted(losses)] == \
        [m["loss"] for _, m in sorted(_metrics(ref_dir).items())]


def _worker(tiny, name: str, **overrides):
    """An inline DPO worker over the reference run's data, with `overrides` on the config."""
    from posttrain.config.loader import to_dict
    from posttrain.train.dpo import DPO
    from posttrain.train.recipe import RecipeWorker
    tmp, config, ref_dir = tiny
    cfg = yaml.safe_load(config.read_text())
    for dotted, value in overrides.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    cfg = to_dict(build(DPOConfig, cfg))
    run_dir = tmp / name
    run_dir.mkdir(exist_ok=True)
    return RecipeWorker(DPO, cfg, cfg["model"]["hf_dir"] or str(ref_dir / "base_model"),
                     str(ref_dir / "prepared"), str(run_dir)), run_dir


def test_packed_pairs_give_the_loss_of_padded_pairs(tiny):
    """The trained policy against the starting model's reference log-probs, both layouts."""
    tmp, _, ref_dir = tiny
    results = {}
    for mode in ("packed", "padded"):
        # the reference log-probs of the starting model; the policy is the trained export
        shutil.copytree(ref_dir / "reference", tmp / f"layout-{mode}" / "reference")
        worker, _ = _worker(tiny, f"layout-{mode}", **{
            "model.hf_dir": str(ref_dir / "hf"), "model.init": None,
            "train.loader.mode": mode, "train.loader.rows_per_batch": 2 if mode == "padded" else 1,
            "train.tokens_per_step": 2048 if mode == "padded" else 1024})
        worker.before_training()
        results[mode] = worker.evaluate()
        worker.close()
    packed, padded = results["packed"], results["padded"]
    assert packed["eval_pairs"] == padded["eval_pairs"] == EVAL_PAIRS
    assert packed["eval_batches"] < padded["eval_batches"]      # several pairs per packed row
    assert packed["eval_accuracy"] == padded["eval_accuracy"] > 0.7
    for key in ("eval_loss", "eval_margins", "eval_rewards_chosen", "eval_rewards_rejected",
                "eval_logps_chosen", "eval_logps_rejected"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-5), key


def test_lora_reference_is_the_base_model_with_adapters_disabled(tiny):
    worker, _ = _worker(tiny, "lora", **{
        "model.lora": {"rank": 4, "alpha": 8.0}, "export.format": "peft",
        "reference": {"kind": "lora_base"}})
    try:
        assert worker.before_training() == {}
        assert worker.engine.num_trainable < worker.engine.num_params / 5
        first, second = worker.train_step(), worker.train_step()
    finally:
        worker.close()
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["margins"] == 0
    assert second["loss"] != first["loss"] and second["margins"] != 0


@pytest.mark.parametrize("change, message", [
    ({"data.format": "chat"}, "DPO trains on preference data"),
    ({"train.loader.format": "sequence"}, "train.loader.format: preference"),
    ({"reference": {"kind": "lora_base"}}, "lora_base needs model.lora"),
    ({"train.loader.packing.max_tokens_per_pack": 128}, "must hold a whole pair"),
    ({"loss.loss_type": "ipo", "loss.label_smoothing": 0.1}, "sigmoid, robust and simpo"),
    ({"train.dpo": {"beta": 0.1}}, "moved: DPO's loss settings are the top-level `loss:`"),
])
def test_bad_configs_name_the_key(tiny, change, message):
    _, config, _ = tiny
    cfg = yaml.safe_load(config.read_text())
    for dotted, value in change.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
    with pytest.raises((ConfigError, ValueError), match=message):
        build(DPOConfig, cfg)
