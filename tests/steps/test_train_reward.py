"""steps/train_reward.py on a tiny model (hidden 64, 2 layers) and the bundled pairs.

Proves: the scalar-head model trained with Bradley-Terry beats chance on held-out pairs (in the
trainer and through the exported artifact); the export is an HF causal LM body plus
`reward_head.safetensors` / `reward_head.json`; `load_reward_model` gives a
`score(prompt_messages, completion_text) -> float` callable whose scores equal the trainer's
rewards for the same sequences; a run SIGKILLed after a checkpoint and started again ends with
the uninterrupted run's losses and byte-identical body and head.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.models.reward_model import load_reward_model
from posttrain.train.reward import last_response_index

from .conftest import run_and_kill, run_to_end, safetensors, tiny_recipe
from .golden import check_golden

_run_to_end = partial(run_to_end, "steps.train_reward")
_run_and_kill = partial(run_and_kill, "steps.train_reward")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains the reference runs
TRAIN_PAIRS, EVAL_PAIRS = 300, 60
MAX_STEPS, KILL_STEP = 30, 15

CONFIG = {
    **tiny_recipe("preference", 96, tied=False),
    "train": {"max_steps": MAX_STEPS, "tokens_per_step": 1024,
              "loader": {"format": "preference",
                         "packing": {"max_tokens_per_pack": 256, "buffer_samples": 16},
                         "rows_per_batch": 1, "shuffle_buffer_samples": 64, "seed": 0,
                         "epochs": 3},
              "optimizer": {"lr": 0.003, "weight_decay": 0.0, "betas": [0.9, 0.95]},
              "scheduler": {"kind": "constant", "warmup_steps": 0},
              "checkpoint_every_steps": 5, "seed": 0},
    "eval": {"max_batches": 100},
}


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The uninterrupted reference run (a subprocess, as the SIGKILL test's runs): the tmp
    directory and its result.json."""
    tmp = tmp_path_factory.mktemp("reward")
    for split, rows in (("train", TRAIN_PAIRS), ("eval", EVAL_PAIRS)):
        lines = (ROOT / "assets/data/preference" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["run"]["dir"] = str(tmp / "unused")
    cfg["data"]["train"] = [{"name": "pairs", "path": str(tmp / "train.jsonl")}]
    cfg["data"]["eval"] = [{"name": "pairs", "path": str(tmp / "eval.jsonl")}]
    (tmp / "reward.yaml").write_text(yaml.safe_dump(cfg))
    _run_to_end(tmp / "reward.yaml", tmp / "run")
    return tmp, json.loads((tmp / "run" / "result.json").read_text())


def test_first_losses_match_the_golden_values(trained):
    tmp, _ = trained
    check_golden("reward", _losses(tmp / "run"))


def test_sigkill_and_restart_gives_bit_identical_weights(trained):
    """Killed right after checkpoint KILL_STEP and started again, the run ends with the
    reference's losses and byte-identical safetensors, the reward head's included: catches
    reward-model state a checkpoint misses (the head's weights or optimizer state, the
    pair loader's position) or a head re-initialized on resume."""
    tmp, _ = trained
    run_dir = tmp / "killed"
    _run_and_kill(tmp / "reward.yaml", run_dir, KILL_STEP)
    _run_to_end(tmp / "reward.yaml", run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, MAX_STEPS)
    got = safetensors(run_dir / "hf")
    assert "reward_head.safetensors" in got
    assert got == safetensors(tmp / "run" / "hf")
    assert _losses(run_dir) == _losses(tmp / "run")


def test_reward_model_beats_chance_on_held_out_pairs(trained):
    tmp, result = trained
    ev = result["eval"]
    print(f"reward model: held-out accuracy {ev['eval_accuracy']:.3f}, margin "
          f"{ev['eval_margins']:.4f}, loss {ev['eval_loss']:.4f}")
    assert ev["eval_pairs"] == EVAL_PAIRS
    assert ev["eval_accuracy"] > 0.7 and ev["eval_margins"] > 0
    assert ev["eval_loss"] < math.log(2)
    out = Path(result["hf_dir"])
    meta = json.loads((out / "reward_head.json").read_text())
    assert meta["kind"] == "scalar_reward_head" and meta["hidden_size"] == 64
    from transformers import AutoModelForCausalLM
    body = AutoModelForCausalLM.from_pretrained(out)           # a plain HF checkpoint
    assert body.config.num_hidden_layers == 2


def test_exported_model_loads_as_a_reward_callable(trained):
    tmp, result = trained
    score = load_reward_model(result["hf_dir"])
    rows = [json.loads(x) for x in (tmp / "eval.jsonl").read_text().splitlines()]
    wins = 0
    for r in rows:
        chosen = score(r["prompt"], r["chosen"][0]["content"])
        rejected = score(r["prompt"], r["rejected"][0]["content"])
        assert isinstance(chosen, float)
        wins += chosen > rejected
    print(f"reward callable: {wins} of {len(rows)} held-out pairs ranked right")
    assert wins / len(rows) > 0.7


def test_callable_scores_equal_the_trainers_rewards(trained):
    """The same head at the same token: the trainer's pooling over a packed batch."""
    from posttrain.data.loader import LoaderConfig, TrainLoader, sources_from_manifest
    from posttrain.data.packing import PackingConfig
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.models.hf_io import load_hf
    tmp, result = trained
    score = load_reward_model(result["hf_dir"])
    model = load_hf(result["hf_dir"]).eval()
    head = torch.nn.Linear(64, 1)
    from safetensors.torch import load_file
    head.load_state_dict(load_file(str(Path(result["hf_dir"]) / "reward_head.safetensors")))
    cfg = LoaderConfig(packing=PackingConfig(max_tokens_per_pack=256), format="preference",
                       background=False)
    with TrainLoader(sources_from_manifest(result["prepared_dir"], "eval"), cfg) as loader:
        batch = next(iter(loader))
    with torch.no_grad():
        hidden = model(batch["input_ids"], batch["position_ids"], batch["document_lengths"])
        seq = batch["sequence_ids"]
        last = last_response_index(batch["labels"], seq, int(seq.max()) + 1)
        rewards = head(hidden.reshape(-1, 64)[last]).squeeze(-1)
    tok = ChatTokenizer(TokenizerConfig(path=result["hf_dir"]))
    rows = [json.loads(x) for x in (tmp / "eval.jsonl").read_text().splitlines()]
    by_ids = {}
    for r in rows:
        c, j = tok.encode_preference(r["prompt"], r["chosen"], r["rejected"])
        by_ids[tuple(c.input_ids)] = (r["prompt"], r["chosen"][0]["content"])
    ids, checked = batch["input_ids"].reshape(-1), 0
    for s in range(int(seq.max()) + 1):
        key = tuple(ids[seq.reshape(-1) == s].tolist())
        if key in by_ids:
            assert score(*by_ids[key]) == pytest.approx(float(rewards[s]), abs=1e-4)
            checked += 1
    assert checked >= 1
