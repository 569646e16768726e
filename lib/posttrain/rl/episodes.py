"""Episodes: rollouts driven by an environment, over one or more turns, token in and token out.

`EpisodeRunner.run(rows, n, generate, sampling)` plays `n` episodes of each prompt row with the
configured environment (`posttrain.rl.environment`) and returns them as `Episode`s, n per row:

    turn 0   every row's environment is reset (the n episodes of a row share a seed and start
             from the same messages); the engine samples n answers of each prompt in one call,
             exactly the call of a single-turn step (same prompts, sampling and seed), so the
             single-turn environment reproduces plain rollouts bit for bit
    step     every episode's environment sees its turn (in threads) and answers, or says done
    turn t   the live episodes' token ids so far go to the engine in one batch (n = 1 each),
             sampled with a seed derived from (the call's seed, t): a resumed run replays them

An episode ends when the environment says done, when a turn is cut by the token budget, when the
model stops without the template's end-of-turn token (e.g. at eos; Gemma 4's
``<|tool_response>``, which hands a tool call over, counts as one), or after
`environment.max_turns` turns (``finish_reason``: ``stop``, ``length``, ``length``/``stop``,
``turns``). The token budget, `environment.max_total_tokens`, bounds everything after the prompt:
a turn samples at most what is left, and an environment reply that does not fit (with room for
one more token) ends the episode instead.

**Token-in/token-out.** An episode's ids are the prompt ids, then per turn the ids the engine
sampled (loss mask 1, the engine's log-probs) followed by the ids of the environment's reply
(`ChatTokenizer.encode_continuation`: the template's glue after the end-of-turn token, the new
messages, the next assistant header; loss mask 0, log-prob 0). The model's tokens are never
decoded and encoded again, so the trainer scores exactly the tokens the engine sampled, even where
a template would render an earlier turn differently (Qwen3 drops earlier reasoning) or the text
would tokenize otherwise. The environment and the reward functions see text: a turn decoded
without special tokens.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from posttrain.data.tokenizer import ChatTokenizer
from posttrain.errors import ConfigError
from posttrain.rl.engine import Rollout, SamplingConfig
from posttrain.rl.environment import EnvironmentConfig, Message, StepResult, Turn
from posttrain.rl.prompts import PromptRow, prompt_columns
from posttrain.rl.rewards import CombinedReward, RewardFailures, RewardOutput

__all__ = ["Episode", "EpisodeRunner", "episode_metrics", "score_episodes", "turn_seed"]

Generate = Callable[[list[list[int]], SamplingConfig, int], list[list[Rollout]]]

# turn t > 0 samples with seed + t * stride; a prime other than the rounds' stride
_TURN_SEED_STRIDE = 998_244_353
_OBSERVATION_ROLES = ("tool", "user", "system")


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a call seeded `seed` (turn 0 keeps it)."""
    return (seed + turn * _TURN_SEED_STRIDE) % (2 ** 63)


def _merge_routing(before: torch.Tensor | None, turn: torch.Tensor) -> torch.Tensor:
    """An episode's routing record (`Rollout.routing`) after a turn whose call ran the whole
    episode so far: a position keeps the record of the first call that ran it (the one whose
    sampled tokens read it first); the turn's record adds the rest (the previous turn's last
    token, the environment's reply, the new turn)."""
    if before is None:
        return turn
    kept = before[:, :1, :1] >= 0
    return torch.cat([torch.where(kept, before, turn[:len(before)]), turn[len(before):]])


def _group_seed(seed: int, group: int) -> int:
    return (seed * 1_000_003 + group) % (2 ** 63)


@dataclass
class Episode(Rollout):
    """A rollout of one or more turns. `completion_ids` is everything after the prompt (the
    model's turns and the environment's replies); `loss_mask` is 1 on the sampled tokens,
    `logprobs` the engine's there and 0 elsewhere. `messages` is the conversation as text,
    `answer` the last turn's text (what the reward functions score), `env_reward` the sum of
    the environment's rewards, `metrics` the sums of its step metrics; `routing` (routing
    replay) the experts of every position, merged over the turns (`_merge_routing`). All fields
    are plain data or a tensor, so ``Episode(**dataclasses.asdict(e))`` round-trips."""

    loss_mask: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    answer: str = ""
    env_reward: float = 0.0
    turns: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def context(self) -> list[Message]:
        """The messages the final answer answers (all before the last assistant turn)."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return self.messages[:last]


@dataclass
class _Live:
    """An episode being played, with its environment and the tools it renders with."""

    episode: Episode
    env: Any
    tools: list[dict] | None


class EpisodeRunner:
    """Plays episodes of the environment `cfg` (module docstring). `tokenizer` renders the
    environment's messages; `stop_token_ids` are the sampling's (a multi-turn environment needs
    the template's end-of-turn token among them: `stop_key` names where they are set)."""

    def __init__(self, cfg: EnvironmentConfig, tokenizer: ChatTokenizer,
                 stop_token_ids: Sequence[int], stop_key: str = "sampling.stop_tokens"):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.end_of_turn: int | None = None
        self.handover: int | None = None      # Gemma 4's <|tool_response> after a tool call
        if not cfg.single_turn:
            self.end_of_turn = tokenizer.end_of_turn_token_id
            if self.end_of_turn is None or self.end_of_turn not in stop_token_ids:
                raise ConfigError(
                    f"{stop_key}: a multi-turn environment needs the chat template's end of "
                    f"turn {tokenizer.layout.end_of_turn!r} as a stop token (one token), so a "
                    "turn ends where the environment answers")
            self.handover = tokenizer.tool_handover_token_id
            if self.handover is not None and self.handover not in stop_token_ids:
                token = tokenizer.hf.convert_ids_to_tokens(self.handover)
                raise ConfigError(
                    f"{stop_key}: this chat template ends a turn that calls a tool with "
                    f"{token!r}, where the tool's result follows; a multi-turn environment "
                    "needs it as a stop token too, or the model writes the result itself")

    def run(self, rows: Sequence[PromptRow], n: int, generate: Generate,
            sampling: SamplingConfig) -> list[list[Episode]]:
        """`n` episodes of each row, result[i][j] episode j of rows[i]; `generate(prompts,
        sampling, n)` is a rollout engine's (`posttrain.rl.engine.RolloutEngine.generate`)."""
        budget = self.cfg.token_budget(sampling.max_new_tokens)
        groups = [self._start(row, n, _group_seed(sampling.seed, g))
                  for g, row in enumerate(rows)]
        first = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget))
        out = generate([group[0].episode.prompt_ids for group in groups], first, n)
        live = [x for group in groups for x in group]
        rollouts = [r for group in out for r in group]
        turn = 0
        with ThreadPoolExecutor(self.cfg.max_workers or os.cpu_count() or 1) as pool:
            while True:
                live = self._advance(live, rollouts, turn, budget, pool)
                if not live:
                    break
                turn += 1
                room = max(budget - len(x.episode.completion_ids) for x in live)
                step = replace(sampling, seed=turn_seed(sampling.seed, turn),
                               max_new_tokens=min(sampling.max_new_tokens, room))
                rollouts = [g[0] for g in generate(
                    [x.episode.prompt_ids + x.episode.completion_ids for x in live], step, 1)]
        return [[x.episode for x in group] for group in groups]

    def _start(self, row: PromptRow, n: int, seed: int) -> list[_Live]:
        """The n episodes of one prompt row, reset with one seed."""
        envs = [self.cfg.make() for _ in range(n)]
        starts = [env.reset(row, seed) for env in envs]
        if any(s != starts[0] for s in starts[1:]):
            raise RuntimeError(f"environment {self.cfg.name}: reset(row, seed) gave different "
                               "messages for the episodes of one prompt; make it a function "
                               "of (row, seed)")
        messages, tools = starts[0], getattr(envs[0], "tools", None) or None
        ids = (row.prompt_ids if messages == row.messages and not tools
               else self.tokenizer.encode_prompt(messages, tools=tools))
        return [_Live(Episode(list(ids), [], [], "stop", messages=list(messages)), env, tools)
                for env in envs]

    def _advance(self, live: list[_Live], rollouts: list[Rollout], index: int, budget: int,
                 pool: ThreadPoolExecutor) -> list[_Live]:
        """Record turn `index` of every live episode, step the environments, append their
        replies; returns the episodes that go on."""
        turns = [self._record(x.episode, r, index, budget) for x, r in zip(live, rollouts)]
        results = list(pool.map(lambda xt: xt[0].env.step(xt[1][0]), zip(live, turns)))
        going = []
        for x, (turn, ends_turn), result in zip(live, turns, results):
            ep = x.episode
            self._check(result)
            ep.env_reward += float(result.reward)
            for k, v in result.metrics.items():
                ep.metrics[k] = ep.metrics.get(k, 0.0) + float(v)
            finish = self._finish(ep, turn, ends_turn, result)
            if finish is None and ends_turn and turn.token_ids[-1] == self.handover:
                ep.messages[-1] = self._tool_call_message(result)
            if finish is None:
                reply = [{**m, "content": self.tokenizer.remove_special_tokens(m["content"])}
                         for m in result.messages]
                ids = self.tokenizer.encode_continuation(ep.messages, reply, tools=x.tools)
                if len(ep.completion_ids) + len(ids) < budget:
                    ep.completion_ids += ids
                    ep.logprobs += [0.0] * len(ids)
                    ep.loss_mask += [0] * len(ids)
                    ep.messages += reply
                    going.append(x)
                    continue
                finish = "length"
            ep.finish_reason = finish  # type: ignore[assignment]
        return going

    def _tool_call_message(self, result: StepResult) -> Message:
        """The assistant message of a turn that handed over to a tool, as the template renders
        it before the results: the calls the environment read, as structure (Gemma 4 renders
        each result after them, named by its call)."""
        if not result.tool_calls:
            raise ValueError(
                f"environment {self.cfg.name}: the turn handed over to a tool, and this chat "
                "template renders the results from the calls: return the calls read from "
                "the turn as StepResult.tool_calls (posttrain.rl.tools does)")
        return {"role": "assistant", "content": "", "tool_calls": list(result.tool_calls)}

    def _record(self, ep: Episode, rollout: Rollout, index: int, budget: int
                ) -> tuple[Turn, bool]:
        """Append a sampled turn (cut to the budget); (the turn, whether it ends with the
        template's end of turn)."""
        room = budget - len(ep.completion_ids)
        ids = list(rollout.completion_ids[:room])
        finish = "length" if len(ids) < len(rollout.completion_ids) else rollout.finish_reason
        ep.completion_ids += ids
        ep.logprobs += list(rollout.logprobs[:room])
        ep.loss_mask += [1] * len(ids)
        if rollout.routing is not None:
            ep.routing = _merge_routing(
                ep.routing, rollout.routing[:len(ep.prompt_ids) + len(ep.completion_ids)])
        ends_turn = finish == "stop" and ids[-1] in (self.end_of_turn, self.handover)
        decode = self.tokenizer.hf.decode
        own = ids[:-1] if ends_turn else ids
        text = self.tokenizer.remove_special_tokens(decode(own, skip_special_tokens=True))
        ep.answer = decode(ids, skip_special_tokens=True)
        ep.messages.append({"role": "assistant", "content": text})
        ep.turns += 1
        return Turn(text, tuple(ids), finish, index, decode(own)), ends_turn

    def _finish(self, ep: Episode, turn: Turn, ends_turn: bool, result: StepResult
                ) -> str | None:
        """Why the episode ends after this turn, or None when it goes on."""
        if turn.finish_reason == "length":
            return "length"
        if result.done:
            return "stop"
        if not ends_turn:                 # the model stopped without ending its turn (eos)
            return "stop"
        if ep.turns >= self.cfg.turns:
            return "turns"
        return None

    def _check(self, result: Any) -> None:
        name = self.cfg.name
        if not isinstance(result, StepResult):
            raise TypeError(f"environment {name}: step() returned {type(result).__name__}; "
                            "return a posttrain.rl.environment.StepResult")
        for m in result.messages:
            if (not isinstance(m, dict) or m.get("role") not in _OBSERVATION_ROLES
                    or not isinstance(m.get("content"), str)):
                raise ValueError(f"environment {name}: step() returned the message {m!r}; "
                                 f"messages are {{'role': one of {list(_OBSERVATION_ROLES)}, "
                                 "'content': str}")
        if not result.done and not result.messages:
            raise ValueError(f"environment {name}: step() returned no messages and done=False; "
                             "say done, or answer the turn")


# --------------------------------------------------------------------------- rewards, metrics


def score_episodes(reward: CombinedReward, rows: Sequence[PromptRow],
                   groups: Sequence[Sequence[Episode]], *, environment: bool) -> RewardOutput:
    """The reward functions on each episode's final answer (their ``prompts``: the conversation
    before it; ``columns``: its row's), plus, when `environment`, the environment's rewards as
    the component ``environment`` (weight 1)."""
    k = len(groups[0])
    episodes = [e for group in groups for e in group]
    columns = {name: [v for v in col for _ in range(k)]
               for name, col in prompt_columns(list(rows)).items()}
    out = reward([e.answer for e in episodes], [e.context for e in episodes], columns)
    if not environment:
        return out
    env = [e.env_reward for e in episodes]
    return RewardOutput(total=[t + r for t, r in zip(out.total, env)],
                        components={**out.components, "environment": env},
                        failures={**out.failures, "environment": RewardFailures()})


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Turns, how episodes ended, environment tokens, and the environment's own metrics, as
    means per episode (``env/...``)."""
    n = len(episodes)
    names = sorted({k for e in episodes for k in e.metrics})
    return {"env/turns_mean": sum(e.turns for e in episodes) / n,
            "env/done_fraction": sum(e.finish_reason == "stop" for e in episodes) / n,
            "env/turn_limit_fraction": sum(e.finish_reason == "turns" for e in episodes) / n,
            "env/environment_tokens_mean":
                sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes) / n,
            **{f"env/{k}": sum(e.metrics.get(k, 0.0) for e in episodes) / n for k in names}}
