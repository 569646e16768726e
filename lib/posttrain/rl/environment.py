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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from posttrain.config.loader import import_attribute
from posttrain.config.rl import BUNDLED_ENVIRONMENTS, EnvironmentConfig
from posttrain.rl.rewards import parse_number

if TYPE_CHECKING:                       # prompts reads shards (pyarrow, torch): not needed here
    from posttrain.rl.prompts import PromptRow

__all__ = ["Environment", "EnvironmentConfig", "Message", "RetryEnvironment",
           "SingleTurnEnvironment", "StepResult", "Turn", "bundled_environments"]

Message = dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the environment sees it: its text (special tokens removed, the
    end-of-turn or tool hand-over token dropped), the sampled ids, and why sampling stopped
    (``stop``: the end-of-turn or another stop token; ``length``: the turn's token budget ran
    out); `raw`, the same text with its special tokens (Gemma 4 writes tool calls between
    them)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    index: int                               # 0 for the first turn of the episode
    raw: str = ""


@dataclass(frozen=True)
class StepResult:
    """What answers a turn (module docstring). `tool_calls` are the calls the environment read
    in a turn that handed over to a tool (OpenAI's shape, each with the ``id`` its result's
    ``tool_call_id`` names): a template that renders calls from that structure, and the
    results inside the model's turn (Gemma 4), needs them to render the results; the
    episode then keeps them as that assistant message's ``tool_calls``."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


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


def bundled_environments() -> dict[str, Callable[..., Any]]:
    """Name -> factory of the environments that ship with posttrain."""
    return {name: import_attribute(spec, f"environment.kind: {name}")
            for name, spec in BUNDLED_ENVIRONMENTS.items()}


