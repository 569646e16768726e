"""SFT and GRPO on the native families added for 2026's models, end to end through the CLI.

For each family, a tiny random checkpoint (`model.init`: the family's tiny config of
`posttrain.models.verify`, written through transformers) trains with
- SFT: 10 steps of packed chat rows (128-token packs, documents crossing the delta rule's
  chunks and each other), one inline worker, a checkpoint after every step;
- GRPO: 10 steps on the arithmetic prompts with a graded reward (numeric closeness), 4 prompts
  x 4 samples x 16 new tokens, rollouts from the colocated native engine (its decode cache),
  two mini-batches per step, a checkpoint after every step.

What is proved, per family and recipe:
- the first 10 losses (SFT) and policy entropies of the rollouts (GRPO: the pg loss of a
  group-normalised batch is ~0 at ratio 1 by construction, so the entropy of the sampled
  tokens under the policy is the number every weight moves) equal stored golden values
  (tests/golden/families/, within tests/steps/golden.py's tolerance; fewer for the runs
  whose later steps differ between CPU kernels, `STABLE_STEPS`);
- SIGKILL after step 4 and a restart (run in this process) give bit-identical exported
  weights and the same per-step metrics as the uninterrupted run (DeepSeek-V3 with bias
  balancing on: the routers' score-correction bias moves every step, and resumes exactly).

The references run in this process (no interpreter start-up); only the killed run is a
subprocess, as SIGKILL needs one. About 8 s (SFT) and 12 s (GRPO) per family on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from steps import train_grpo, train_sft

from .conftest import run_and_kill, safetensors
from .golden import check_golden

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FAMILIES = ["qwen3_5", "qwen3_5_moe", "gemma4", "deepseek_v3"]
# DeepSeek-V3 trains with auxiliary-loss-free balancing on, so that resume and export carry the
# routers' moving score-correction bias
MODEL_OPTIONS = {"deepseek_v3": {"moe_bias_update_speed": 0.001}}
STEPS, KILL_STEP = 10, 4

SFT = {
    "run": {"num_workers": 1, "launcher": "inline"},
    "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
    "data": {"format": "chat", "max_tokens_per_sample": 128, "on_bad_row": "skip"},
    "model": {"dtype": "float32"},
    "train": {"max_steps": STEPS, "tokens_per_step": 256,      # 2 micro-batches of 1 x 128
              "loader": {"packing": {"max_tokens_per_pack": 128, "buffer_samples": 16},
                         "rows_per_batch": 1, "shuffle_buffer_samples": 32, "seed": 0},
              "optimizer": {"lr": 0.001, "weight_decay": 0.01, "betas": [0.9, 0.95]},
              "scheduler": {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
              "grad_clip_norm": 1.0, "seed": 0,
              "checkpoint_every_steps": 1, "keep_checkpoints": 100},
    "eval": {"max_batches": 1},
}
GRPO = {
    "run": {"num_workers": 1, "launcher": "inline"},
    "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
    "data": {"format": "prompt", "max_tokens_per_sample": 64, "on_bad_row": "error",
             "train": [{"name": "arithmetic",
                        "path": str(ROOT / "assets/data/arithmetic/train.jsonl")}]},
    "model": {"dtype": "float32"},
    "train": {"max_steps": STEPS, "prompts_per_step": 4, "samples_per_prompt": 4,
              "mini_batches": 2, "max_tokens_per_micro_batch": 2048,
              "optimizer": {"lr": 1.0e-3, "weight_decay": 0.0, "betas": [0.9, 0.99]},
              "scheduler": {"kind": "constant", "warmup_steps": 0}, "grad_clip_norm": 1.0,
              "seed": 0, "checkpoint_every_steps": 1, "keep_checkpoints": 100},
    "algorithm": {"normalize_std": True, "clip_low": 0.2, "clip_high": 0.28,
                  "aggregation": "token_mean", "kl_coef": 0.0, "reference": "none"},
    "sampling": {"temperature": 1.0, "max_new_tokens": 16},
    "rewards": {"functions": [{"name": "numeric_closeness", "weight": 1.0}]},
    "rollout": {"kind": "native", "placement": "colocated"},
    "export": {"format": "full"},
}
RECIPES = {"sft": (SFT, train_sft, "loss"), "grpo": (GRPO, train_grpo, "entropy")}
# How many of the 10 golden values hold within GOLDEN_ATOL across CPU kernels: measured over
# ATEN_CPU_CAPABILITY default / avx2 / avx512 x 1 / 2 threads against the stored values
# (tests/golden/README.md). Elsewhere all 10. Gemma 4's tiny model attends with scale 1 over
# normed queries and keys (sharp softmaxes) and routes through its MoE block: after a few
# steps, kernel rounding moves its losses by 1e-4 to 5e-3 and its rollouts' entropies by
# 3e-5 to 8e-4; DeepSeek-V3's entropies move by 1e-5 from step 6.
STABLE_STEPS = {"sft_gemma4": 3, "grpo_gemma4": 2, "grpo_deepseek_v3": 5}


def _metrics(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("family_data")
    for split, rows in (("train", 96), ("eval", 8)):
        lines = (ROOT / "assets/data/chat" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    return tmp


def _config(recipe: str, family: str, tmp: Path, chat_data: Path) -> Path:
    cfg = json.loads(json.dumps(RECIPES[recipe][0]))
    cfg["run"]["dir"] = str(tmp / "unused")
    cfg["model"]["init"] = {"family": family, "seed": 0}
    cfg["model"].update(MODEL_OPTIONS.get(family, {}))
    if recipe == "sft":
        cfg["data"]["train"] = [{"name": "chat", "path": str(chat_data / "train.jsonl")}]
        cfg["data"]["eval"] = [{"name": "chat", "path": str(chat_data / "eval.jsonl")}]
    path = tmp / f"{recipe}_{family}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_golden_values_and_sigkill_resume(family, recipe, tmp_path, chat_data):
    _, step_module, key = RECIPES[recipe]
    config = _config(recipe, family, tmp_path, chat_data)
    ref_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    step_module.run(config, overrides={"run.dir": str(ref_dir)}, show_progress=False)
    ref = _metrics(ref_dir, key)
    assert sorted(ref) == list(range(1, STEPS + 1))
    check_golden(f"families/{recipe}_{family}", [ref[s] for s in range(1, STEPS + 1)],
                 compare_steps=STABLE_STEPS.get(f"{recipe}_{family}", STEPS))

    # GRPO's checkpoints count optimizer steps (two mini-batches per GRPO step)
    per_step = RECIPES[recipe][0]["train"].get("mini_batches", 1)
    run_and_kill(step_module.__name__, config, killed_dir, KILL_STEP * per_step)
    result = step_module.run(config, overrides={"run.dir": str(killed_dir)},
                             show_progress=False)
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, STEPS)
    assert safetensors(killed_dir / "hf") == safetensors(ref_dir / "hf")
    assert _metrics(killed_dir, key) == ref
    if family in MODEL_OPTIONS:          # the bias moved, and was exported
        from posttrain.models.hf_io import load_hf
        bias = load_hf(ref_dir / "hf").layers[1].mlp.e_score_correction_bias
        assert bias.abs().max() > 0
        assert recipe == "grpo" or _metrics(ref_dir, "moe/max_violation")
