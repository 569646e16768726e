"""The environment interface: the bundled environments, user environments and reward functions
named ``module:attribute`` in the config, and their failures at launch, naming the key."""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path

import pytest

from posttrain.config.loader import build
from posttrain.config.recipes import load_recipe
from posttrain.errors import ConfigError
from posttrain.rl import reward_registry
from posttrain.rl.environment import (EnvironmentConfig, RetryEnvironment,
                                      SingleTurnEnvironment, StepResult, Turn)
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import RewardSpec, combine
from posttrain.train.grpo import GRPOConfig

ROOT = Path(__file__).resolve().parents[3]
ROW = PromptRow([5, 6], [{"role": "user", "content": "What is 2 + 3?"}], {"answer": "5"})
_names = itertools.count()

USER_MODULE = '''
from posttrain.rl.environment import StepResult


class Countdown:
    """Says how many turns are left; done after `turns` turns; reward 1 per turn."""

    def __init__(self, turns, word="left"):
        self.turns, self.word = turns, word

    def reset(self, row, seed):
        return [{"role": "user", "content": f"{row.messages[0]['content']} (seed {seed})"}]

    def step(self, turn):
        left = self.turns - turn.index - 1
        return StepResult([{"role": "user", "content": f"{left} {self.word}"}] if left else [],
                          reward=1.0, done=left == 0)


def brevity(completions, prompts, columns, *, limit=10):
    return [float(len(c) <= limit) for c in completions]


not_callable = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A user's module on the path, under a fresh name (the reward registry keeps names)."""
    name = f"user_rl_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for key in [k for k in reward_registry._REGISTRY if k.startswith(f"{name}:")]:
        reward_registry._REGISTRY.pop(key)


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text, (), "stop", index)


def test_single_turn_is_the_default_and_trivial():
    cfg = EnvironmentConfig()
    assert cfg.single_turn and cfg.turns == 1 and cfg.token_budget(48) == 48
    env = cfg.make()
    assert isinstance(env, SingleTurnEnvironment)
    assert env.reset(ROW, 0) == ROW.messages
    assert env.step(turn("The answer is 5.")) == StepResult(done=True)
    multi = build(EnvironmentConfig, {"kind": "tools", "max_turns": 3})
    assert not multi.single_turn and multi.token_budget(48) == 144
    assert build(EnvironmentConfig, {"kind": "retry", "max_total_tokens": 100}
                 ).token_budget(48) == 100


def test_retry_environment_gives_feedback_until_right():
    env = RetryEnvironment(retry_cost=0.25)
    env.reset(ROW, 0)
    wrong = env.step(turn("The answer is 6."))
    assert not wrong.done and wrong.reward == 0.0
    assert wrong.messages == [{"role": "user", "content": "That is not right. Try again."}]
    right = env.step(turn("Sorry. The answer is 5.", index=2))
    assert right.done and right.reward == 0.5 and right.messages == []
    with pytest.raises(KeyError, match="no column 'result'"):
        RetryEnvironment(column="result").reset(ROW, 0)


def test_user_environment_by_module_and_attribute(user_module):
    cfg = build(EnvironmentConfig, {"module": f"{user_module}:Countdown",
                                    "params": {"turns": 2}, "max_turns": 5})
    env = cfg.make()
    assert cfg.name == f"{user_module}:Countdown" and not cfg.single_turn
    assert env.reset(ROW, 7) == [{"role": "user", "content": "What is 2 + 3? (seed 7)"}]
    assert env.step(turn("a")).messages == [{"role": "user", "content": "1 left"}]
    assert env.step(turn("b", 1)).done


@pytest.mark.parametrize("section, error", [
    ({"module": "no_such_package_xyz.envs:Maze"},
     "environment.module: cannot import module 'no_such_package_xyz.envs'"),
    ({"module": "{mod}:Maze"}, "environment.module: '{mod}:Maze': {mod} has no attribute 'Maze'"),
    ({"module": "{mod}"}, "is not of the form 'package.module:attribute'"),
    ({"module": "{mod}:not_callable"}, "is not callable"),
    ({"module": "{mod}:Countdown"}, "environment.params: missing a required argument: 'turns'"),
    ({"module": "{mod}:Countdown", "params": {"turns": 1, "size": 3}},
     "environment.params: got an unexpected keyword argument 'size'"),
    ({"kind": "maze"}, "environment.kind: 'maze' is not a bundled environment"),
    ({"kind": "tools", "module": "{mod}:Countdown"}, "not both"),
    ({"kind": "tools", "max_turns": 0}, "max_turns must be >= 1"),
])
def test_bad_environment_sections_fail_naming_the_key(user_module, section, error):
    section = {k: v.format(mod=user_module) if isinstance(v, str) else v
               for k, v in section.items()}
    with pytest.raises(ConfigError, match=re.escape(error.format(mod=user_module))):
        build(EnvironmentConfig, section)


def test_user_reward_function_by_module_and_attribute(user_module):
    spec = RewardSpec(name=f"{user_module}:brevity", weight=2.0, params={"limit": 4})
    out = combine([spec, RewardSpec("exact_match_number")])(
        ["The answer is 5.", "5"], [ROW.messages] * 2, {"answer": ["5", "5"]})
    assert out.components[f"{user_module}:brevity"] == [0.0, 1.0]
    assert out.total == [1.0, 3.0]
    with pytest.raises(ConfigError, match="unknown params"):
        RewardSpec(name=f"{user_module}:brevity", params={"limt": 4})
    with pytest.raises(ConfigError, match="is not a reward function"):
        RewardSpec(name=f"{user_module}:Countdown")


def test_a_grpo_config_refuses_a_failing_import_at_launch(user_module):
    """Loading the config (what `posttrain train-grpo` does first) fails, naming the key."""
    config = ROOT / "configs" / "grpo" / "tiny.yaml"
    with pytest.raises(ConfigError, match="environment.module: cannot import module 'nope_xyz'"):
        load_recipe(config, GRPOConfig, {"environment.module": "nope_xyz:Env"})
    with pytest.raises(ConfigError, match="rewards.functions: cannot import module 'nope_xyz'"):
        load_recipe(config, GRPOConfig, {"rewards.functions": [{"name": "nope_xyz:fn"}]})
    cfg = load_recipe(config, GRPOConfig, {
        "environment": {"module": f"{user_module}:Countdown", "params": {"turns": 2},
                        "max_turns": 3, "max_total_tokens": 120},
        "rewards.functions": [{"name": f"{user_module}:brevity"}]})
    assert cfg.episode_tokens == 120 and not cfg.environment.single_turn
    assert load_recipe(config, GRPOConfig).environment.single_turn
    with pytest.raises(ConfigError, match="overlong.buffer_tokens=200 exceeds the 120 tokens"):
        load_recipe(config, GRPOConfig, {"environment.kind": "tools",
                                         "environment.max_total_tokens": 120,
                                         "overlong": {"buffer_tokens": 200}})
