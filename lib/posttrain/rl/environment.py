"""Environments for RL: what answers the model between its turns, and how an episode ends.

An environment is created for each episode (one sampled conversation) and driven by
`posttrain.rl.episodes`:

    messages = env.reset(row, seed)        # the conversation the model answers first
    loop:
        the engine samples an assistant turn (token ids; the environment sees its text)
        result = env.step(turn)            # StepResult(messages, reward, done, metrics)
        done, or the turn / token budget spent -> the episode ends
        else result.messages (tool results, a user's feedback) are rendered with the chat
        template and appended, and the model answers again

``reset(row, seed)`` gets the prompt row (`posttrain.rl.prompts.PromptRow`: its ``messages``
and the dataset's other columns in ``extras``) and a seed; the `samples_per_prompt` episodes
of a group get the same seed and must start from the same messages (they are sampled from one
prompt). ``step`` returns the messages that answer the turn (roles ``tool``, ``user`` or
``system``; none when done), a reward (summed over the episode into the reward component
``environment``), whether the episode is over, and numbers to log (averaged per episode as
``env/<name>``). An environment may list ``tools`` (JSON schemas), which go to the chat template
as its ``tools`` variable. Keep an environment a function of (row, seed, the turns it saw) so a
resumed run replays it exactly.

The episode's final answer, its last assistant turn, is also scored by the configured reward
functions (`posttrain.rl.rewards`, their ``prompts`` argument being the conversation before that
turn), so the single-turn case is the trivial environment: ``reset`` returns the row's messages
and the first ``step`` says done.

Configured under ``environment:`` in a GRPO config: ``{kind: single_turn}`` (the default),
``{kind: tools, params: {tools: [calculator, python]}, max_turns: 3}`` (`posttrain.rl.tools`),
``{kind: retry}`` (a wrong answer is told to try again), or an environment of your own,
``{module: "my_pkg.envs:Maze", params: {size: 5}}``, where ``Maze(**params)`` makes one
episode's environment; the import is checked when the config is built, and so are the params,
against the factory's signature and, when it has one, its ``check_params(**params)`` (which
raises ValueError for what it refuses: the tools environment refuses the python tool where no
isolated sandbox works).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from posttrain.config.loader import import_attribute
from posttrain.errors import ConfigError
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import parse_number

__all__ = ["Environment", "EnvironmentConfig", "Message", "RetryEnvironment",
           "SingleTurnEnvironment", "StepResult", "Turn", "bundled_environments"]

Message = dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the environment sees it: its text (special tokens removed, the
    end-of-turn token dropped), the sampled ids, and why sampling stopped (``stop``: the
    end-of-turn or another stop token; ``length``: the turn's token budget ran out)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    index: int                               # 0 for the first turn of the episode


@dataclass(frozen=True)
class StepResult:
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (module docstring)."""

    def reset(self, row: PromptRow, seed: int) -> list[Message]:
        ...

    def step(self, turn: Turn) -> StepResult:
        ...


class SingleTurnEnvironment:
    """The trivial environment: the row's prompt, one answer, done (rewards come from the
    configured reward functions)."""

    def reset(self, row: PromptRow, seed: int) -> list[Message]:
        return row.messages

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class RetryEnvironment:
    """A question with a numeric answer (the row's `column`); a wrong final number is answered
    by `feedback` as a user message and the model tries again, until right or out of turns.
    Reward 1 for a right answer, less `retry_cost` per earlier wrong one."""

    def __init__(self, column: str = "answer", feedback: str = "That is not right. Try again.",
                 retry_cost: float = 0.0):
        self.column, self.feedback, self.retry_cost = column, feedback, retry_cost
        self.answer = None

    def reset(self, row: PromptRow, seed: int) -> list[Message]:
        if self.column not in row.extras:
            raise KeyError(f"the prompt row has no column {self.column!r} (environment "
                           "params.column)")
        self.answer = parse_number(str(row.extras[self.column]))
        return row.messages

    def step(self, turn: Turn) -> StepResult:
        got = parse_number(turn.text)
        if got is not None and got == self.answer:
            return StepResult(reward=1.0 - self.retry_cost * turn.index, done=True,
                              metrics={"solved": 1.0})
        return StepResult([{"role": "user", "content": self.feedback}],
                          metrics={"wrong_answers": 1.0})


# Name -> the environments that ship with posttrain, named as a user's are
# (``package.module:attribute``): the tool environment builds on this module.
BUNDLED_ENVIRONMENTS = {"single_turn": f"{__name__}:SingleTurnEnvironment",
                        "retry": f"{__name__}:RetryEnvironment",
                        "tools": "posttrain.rl.tools:ToolEnvironment"}


def bundled_environments() -> dict[str, Callable[..., Any]]:
    """Name -> factory of the environments that ship with posttrain."""
    return {name: import_attribute(spec, f"environment.kind: {name}")
            for name, spec in BUNDLED_ENVIRONMENTS.items()}


@dataclass(frozen=True)
class EnvironmentConfig:
    """The ``environment:`` section: a bundled `kind` or a user `module` (``pkg.mod:attr``,
    a class or function making one episode's environment from `params`); `max_turns`
    assistant turns per episode at most; `max_total_tokens` tokens after the prompt (the
    model's and the environment's) at most, None: `max_turns` x the sampling budget;
    `max_workers` threads stepping environments in parallel (0: one per CPU core)."""

    kind: str | None = None
    module: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int | None = None
    max_workers: int = 0

    def __post_init__(self) -> None:
        if self.kind is not None and self.module is not None:
            raise ConfigError("environment: set kind (a bundled environment) or module (your "
                              "own, 'package.module:attribute'), not both")
        if self.max_turns < 1:
            raise ConfigError(f"environment.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"environment.max_total_tokens must be >= 1, got "
                              f"{self.max_total_tokens}")
        if self.max_workers < 0:
            raise ConfigError("environment.max_workers must be >= 0 (0: one per CPU core)")
        factory = self.factory()
        try:
            inspect.signature(factory).bind(**self.params)
        except TypeError as e:
            raise ConfigError(f"environment.params: {e} (for {self.name})") from None
        except ValueError:                  # no signature to check (a builtin): trust it
            pass
        check = getattr(factory, "check_params", None)    # what can only be checked here
        if check is not None:
            try:
                check(**self.params)
            except ValueError as e:
                raise ConfigError(f"environment.params ({self.name}): {e}") from None

    @property
    def name(self) -> str:
        return self.module or self.kind or "single_turn"

    @property
    def single_turn(self) -> bool:
        return self.name == "single_turn"

    @property
    def turns(self) -> int:
        """Assistant turns per episode at most (1 for the single-turn environment)."""
        return 1 if self.single_turn else self.max_turns

    def token_budget(self, max_new_tokens: int) -> int:
        """Tokens after the prompt an episode may hold, the model's and the environment's,
        given the sampling budget of one turn."""
        return self.max_total_tokens or self.turns * max_new_tokens

    def factory(self) -> Callable[..., Any]:
        """What makes one episode's environment (called with `params`)."""
        if self.module is not None:
            factory = import_attribute(self.module, "environment.module")
            if not callable(factory):
                raise ConfigError(f"environment.module: {self.module!r} is not callable (a "
                                  "class or function that makes an environment)")
            return factory
        if self.name not in BUNDLED_ENVIRONMENTS:
            raise ConfigError(f"environment.kind: {self.kind!r} is not a bundled environment "
                              f"({', '.join(sorted(BUNDLED_ENVIRONMENTS))}); name your own "
                              "with environment.module: 'package.module:attribute'")
        return import_attribute(BUNDLED_ENVIRONMENTS[self.name], "environment.kind")

    def make(self) -> Environment:
        return self.factory()(**self.params)
