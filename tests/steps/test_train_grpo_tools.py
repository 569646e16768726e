"""steps/train_grpo.py with a multi-turn environment, end to end on CPU.

- a short multi-turn run (the bundled ``retry`` environment: a wrong answer is told to try
  again) from the committed arithmetic SFT checkpoint: episodes of several turns, the loss on
  the model's tokens only, engine and trainer log-probs agreeing on them;
- SIGKILL + restart of a multi-turn run gives bit-identical weights and per-step metrics (the
  turns' samplers are seeded by (step, round, turn));
- a GRPO step whose reward executes code: in the isolated sandbox (bubblewrap), counted in the
  step's metrics by mechanism;
- the bundled tool-use task: SFT (configs/sft/tools_tiny.yaml) then GRPO
  (configs/grpo/tools_tiny.yaml) raises held-out greedy accuracy, confirmed per problem by an
  exact McNemar test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.rl.builtin_rewards import python_exec
from posttrain.rl.rewards import parse_number, register, registered_names
from steps import train_grpo, train_sft

from .conftest import run_and_kill, run_to_end, safetensors
from .test_train_grpo import grpo_config, metrics

ROOT = Path(__file__).resolve().parents[2]
SFT_MODEL = ROOT / "tests" / "fixtures" / "arithmetic_sft"


def retry_config(tmp: Path, name: str, **changes) -> Path:
    """configs/grpo/tiny.yaml from the arithmetic SFT checkpoint with the retry environment,
    small enough for a test, and dotted `changes`."""
    return grpo_config(tmp, SFT_MODEL, name, **{
        "environment": {"kind": "retry", "max_turns": 3},
        "rewards.functions": [{"name": "format", "weight": 0.1}],
        "train.max_steps": 2, "train.prompts_per_step": 4, "train.samples_per_prompt": 4,
        "eval.max_prompts": 8, "eval.num_records": 8, "eval.accuracy_reward": "environment",
        **changes})


def answer_run_as_code(completions: list[str], prompts: list[list[dict]],
                       columns: dict[str, list], **params) -> list[float]:
    """A small code task for a model that writes no code: each completion's final number
    becomes a program that prints it, scored by `python_exec` against the answer; so it
    equals exact_match_number wherever the sandbox really ran the program."""
    programs = []
    for c in completions:
        got = parse_number(c)
        programs.append("no number" if got is None else "```python\nfrom fractions import "
                        f"Fraction\nprint(Fraction({got.numerator}, {got.denominator}))\n```")
    return python_exec(programs, prompts, columns, column="answer", **params)


if "answer_run_as_code" not in registered_names():
    register("answer_run_as_code", columns=("answer",))(answer_run_as_code)


def test_a_grpo_step_runs_reward_code_in_the_isolated_sandbox(tmp_path):
    config = grpo_config(tmp_path, SFT_MODEL, "code", **{
        "rewards.functions": [{"name": "exact_match_number", "weight": 1.0},
                              {"name": "answer_run_as_code", "weight": 0.0,
                               "params": {"timeout_s": 20.0, "max_workers": 2}}],
        "train.max_steps": 1, "train.prompts_per_step": 4, "train.samples_per_prompt": 4,
        "eval.max_prompts": 4})
    result = train_grpo.run(config, overrides={"run.dir": str(tmp_path / "run")},
                            show_progress=False)
    [step] = [m for m in metrics(Path(result["run_dir"])) if "loss" in m]
    # every one of the 16 completions ran (and the baseline evaluation's, before the step)
    assert step["sandbox/runs/bwrap"] >= 16 and "sandbox/runs/weak" not in step, step
    assert step["reward/answer_run_as_code/failures"] == 0
    assert step["reward/answer_run_as_code/mean"] == step["reward/exact_match_number/mean"] > 0


def test_a_short_multi_turn_run(tmp_path):
    """Two GRPO steps of retry episodes (the arithmetic model is wrong about half the time, so
    episodes run to a second and third turn)."""
    result = train_grpo.run(retry_config(tmp_path, "retry"),
                            overrides={"run.dir": str(tmp_path / "run")}, show_progress=False)
    steps = [m for m in metrics(Path(result["run_dir"])) if "loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/turns_mean"] > 1.2, m
        assert m["env/environment_tokens_mean"] > 0
        assert m["reward/environment/mean"] == pytest.approx(m["env/solved"])
        # trained tokens are the model's only: fewer than the completions hold
        assert m["loss_tokens"] < m["response_length/mean"] * 16
        # engine (KV cache, prefix re-prefilled each turn) vs trainer on the sampled tokens
        assert m["logprob_gap"] < 1e-4 and m["sync/max_abs_logprob_diff"] <= 1e-5
    final = result["eval"]
    assert final["eval/env/turns_mean"] >= 1.0 and "eval/environment_mean" in final
    record = result["eval_records"][0]
    assert record["conversation"].startswith("[assistant] ") and record["turns"] >= 1


@pytest.mark.slow
def test_multi_turn_sigkill_and_restart_gives_bit_identical_weights(tmp_path):
    """Measured: about 50 s on one loaded core (three short CLI runs)."""
    config = retry_config(tmp_path, "resume", **{
        "train.max_steps": 3, "train.mini_batches": 2, "train.checkpoint_every_steps": 1,
        "train.keep_checkpoints": 10})
    ref, killed = tmp_path / "reference", tmp_path / "killed"
    run_to_end("steps.train_grpo", config, ref)
    run_and_kill("steps.train_grpo", config, killed, 2)      # after GRPO step 1 of 3
    run_to_end("steps.train_grpo", config, killed)
    assert json.loads((killed / "result.json").read_text())["started_at_step"] == 1
    assert safetensors(killed / "hf") == safetensors(ref / "hf")
    keys = ("reward/total/mean", "loss", "rollout_tokens", "env/turns_mean",
            "env/environment_tokens_mean")
    want = {m["step"]: m for m in metrics(ref) if "loss" in m}
    got = {m["step"]: m for m in metrics(killed) if "loss" in m}
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step


def mcnemar_p(before: list[float], after: list[float]) -> tuple[int, int, float]:
    """Exact two-sided McNemar test of paired 0/1 outcomes: (problems gained, problems lost,
    p), p the binomial probability of a split at least this uneven among the changed ones."""
    gained = sum(a == 0 and b == 1 for a, b in zip(before, after))
    lost = sum(a == 1 and b == 0 for a, b in zip(before, after))
    n = gained + lost
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2 ** n
    return gained, lost, min(1.0, 2 * tail)


@pytest.mark.long
def test_sft_then_grpo_learns_to_use_the_calculator(tmp_path):
    """The bundled tool-use task, as docs/rl.md runs it: SFT, then 30 GRPO steps.

    The SFT data calls the calculator in a third of its solutions and guesses the rest, so the
    SFT model mostly guesses (greedy: it calls the tool on 32% of the 200 held-out problems,
    accuracy 0.21, nearly all of it from tool calls). GRPO's reward is on the final answer;
    calling the tool is what earns it. Measured once (AMD EPYC, 2 shared cores, one torch
    thread): SFT 600 steps in 496 s, GRPO 30 steps in 233 s; held-out greedy accuracy
    0.21 -> 0.64, tool calls on 32% -> 100% of the problems, 88 problems gained and 2 lost
    (McNemar p = 7e-24); this test, both runs and their evaluations, 827 s. The assertions
    leave room for other CPU kinds' kernels.
    """
    sft = train_sft.run(ROOT / "configs/sft/tools_tiny.yaml",
                        overrides={"run.dir": str(tmp_path / "sft")}, show_progress=False)
    result = train_grpo.run(ROOT / "configs/grpo/tools_tiny.yaml", overrides={
        "run.dir": str(tmp_path / "grpo"), "model.hf_dir": sft["hf_dir"],
        "eval.num_records": 200}, show_progress=False)
    before, after = result["baseline_eval"], result["eval"]
    assert before["eval/num_prompts"] == after["eval/num_prompts"] == 200
    was = {r["prompt"]: r["accuracy"] for r in result["baseline_records"]}
    now = {r["prompt"]: r["accuracy"] for r in result["eval_records"]}
    assert len(was) == len(now) == 200 and was.keys() == now.keys()
    gained, lost, p = mcnemar_p([was[k] for k in was], [now[k] for k in was])
    print(f"held-out accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}; "
          f"tool calls {before['eval/env/tool_calls']:.2f} -> {after['eval/env/tool_calls']:.2f}"
          f"; gained {gained}, lost {lost}, McNemar p = {p:.2g}")
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.15
    assert after["eval/env/tool_calls"] >= before["eval/env/tool_calls"] + 0.3
    assert p < 1e-4, (gained, lost, p)
