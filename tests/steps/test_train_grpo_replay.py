"""MoE routing replay in the GRPO recipe, run as a user runs it: the bundled
configs/grpo/moe_replay_tiny.yaml (a tiny random Qwen3-MoE, `algorithm.routing_replay: true`),
shrunk to 10 steps of 4 prompts x 4 samples x 16 new tokens.

- Synchronous (one inline trainer, colocated native engine): the first losses and gradient
  norms are golden values (tests/golden/grpo_moe_replay{,_grad_norm}.json); every step reports
  `routing/mismatch_rate`, which is > 0 (the second mini-batch's policy has moved, and routes
  some tokens otherwise than the engine did), and the engine's weights match the trainer's
  after every sync (the probe has no record: it routes itself).
- Asynchronous (`rollout.max_staleness: 1`, a Ray trainer and a separate engine): every batch
  after the first is sampled by the policy one update older, so the trainer's own routing
  differs from the recorded one; a run SIGKILLed after checkpoint 1 (which holds the batch of
  step 2 made ahead, with its routing records) and restarted ends with bit-identical weights
  and per-step metrics, the mismatch rate of the replayed batch included. Had the record been
  lost, that batch would route itself (no mismatch rate, other losses).
- Refused at launch, naming the key: routing replay with vLLM, or with a dense model.

Numerics of the replay itself (engine and trainer log-probs within 1e-5 under routing flips,
bit-equality when replaying the trainer's own routing, the gate-weight formulas):
tests/lib/rl/test_routing_replay.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttrain.config.recipes import load_recipe
from posttrain.errors import ConfigError
from posttrain.train.grpo import GRPOConfig
from steps import train_grpo

from .conftest import run_and_kill, run_to_end, safetensors
from .golden import GOLDEN_STEPS, check_golden
from .test_train_grpo_algorithms import metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/grpo/moe_replay_tiny.yaml"
pytestmark = pytest.mark.slow
ASYNC_STEPS = 4
# Measured (AMD EPYC, ATEN_CPU_CAPABILITY default / avx2 / the machine's x 1 / 2 threads): the
# first 8 losses stay within 1e-7 of the stored ones; from step 9 a sampled token differs
# between kernel settings (the random model's next-token distributions are nearly flat) and
# the losses move by 5e-5. So 8 are compared, all 10 stored.
STABLE_STEPS = 8


def small_config(tmp: Path, name: str, **changes) -> Path:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["train"].update(max_steps=GOLDEN_STEPS, prompts_per_step=4, samples_per_prompt=4,
                        checkpoint_every_steps=GOLDEN_STEPS)
    cfg["sampling"]["max_new_tokens"] = 16
    cfg["data"].pop("eval")
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    out = tmp / f"{name}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_golden_losses_and_the_mismatch_rate(tmp_path):
    config = small_config(tmp_path, "sync")
    run_dir = tmp_path / "run"
    train_grpo.run(config, overrides={"run.dir": str(run_dir)}, show_progress=False)
    ref = metrics(run_dir)
    assert sorted(ref) == list(range(1, GOLDEN_STEPS + 1))
    steps = [ref[s] for s in sorted(ref)]
    check_golden("grpo_moe_replay", [m["loss"] for m in steps], compare_steps=STABLE_STEPS)
    check_golden("grpo_moe_replay_grad_norm", [m["grad_norm"] for m in steps], atol=1e-4,
                 compare_steps=STABLE_STEPS)
    rates = [m["routing/mismatch_rate"] for m in steps]
    assert all(0 < r < 1 for r in rates), rates
    assert max(m["sync/max_abs_logprob_diff"] for m in steps) <= 1e-5


def test_async_sigkill_restart_keeps_the_routing_of_the_batch_made_ahead(tmp_path):
    config = small_config(tmp_path, "async", **{
        "run.launcher": "ray", "run.resources_per_worker": {"CPU": 1},
        "rollout.placement": "separate", "rollout.num_engines": 1,
        "rollout.resources_per_engine": {"num_cpus": 1}, "rollout.max_staleness": 1,
        "train.max_steps": ASYNC_STEPS, "train.mini_batches": 1,
        "train.checkpoint_every_steps": 1, "train.keep_checkpoints": 10})
    ref, killed = tmp_path / "reference", tmp_path / "killed"
    run_to_end("steps.train_grpo", config, ref, launcher="ray")
    want = metrics(ref)
    assert [want[s]["rollout/staleness"] for s in sorted(want)] == [0.0] + [1.0] * (
        ASYNC_STEPS - 1)
    # one update behind, the engine chose experts the trainer would not: replay overrides them
    assert all(want[s]["routing/mismatch_rate"] > 0 for s in range(2, ASYNC_STEPS + 1))

    run_and_kill("steps.train_grpo", config, killed, 1, launcher="ray")
    ahead = json.loads((killed / "checkpoints" / "step-00000001" / "meta.json").read_text())
    batches = ahead["extra"]["controller"]["rollouts_ahead"]
    assert [b["step"] for b in batches] == [1]
    assert all(e["routing"]["shape"][1:] == [3, 2]       # 3 MoE layers x top-2
               for g in batches[0]["batch"]["groups"] for e in g)
    run_to_end("steps.train_grpo", config, killed, launcher="ray")
    result = json.loads((killed / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (1, ASYNC_STEPS)
    assert safetensors(killed / "hf") == safetensors(ref / "hf")
    got = metrics(killed)
    keys = ("loss", "grad_norm", "reward/total/mean", "routing/mismatch_rate", "logprob_gap")
    for step in want:
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step


def test_replay_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.routing_replay.*rollout.kind: native"):
        load_recipe(CONFIG, GRPOConfig, {"rollout.kind": "vllm"})
    dense = small_config(tmp_path, "dense", **{"model.init": {"family": "qwen3", "seed": 0},
                                               "train.max_steps": 1})
    with pytest.raises(ConfigError, match="algorithm.routing_replay.*no native MoE layers"):
        train_grpo.run(dense, overrides={"run.dir": str(tmp_path / "dense_run")},
                       show_progress=False)
