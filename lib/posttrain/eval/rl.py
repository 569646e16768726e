"""Held-out reward evaluation for RL: generate completions for held-out prompts, score them.

Used by the GRPO controller (at the start, every K steps, at the end) and by the evaluate step
of `flows/grpo_flow.py` (the trained model against the starting one). The generator plays
episodes (`posttrain.rl.episodes`: one turn, or several with an environment) on any rollout
engine (`posttrain.rl.engine`); scores come from the same reward functions as training,
so "accuracy" is the mean of the configured 0/1 reward (exact match by default) over every
completion: with one greedy completion per prompt, greedy accuracy; with k sampled completions
per prompt, the mean@k accuracy RL papers report (the expected accuracy of one sample).
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.rl.episodes import Episode, episode_metrics, score_episodes
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import CombinedReward, RewardOutput

__all__ = ["reward_eval"]


def reward_eval(generate: Callable[[list[PromptRow]], list[list[Episode]]], rows: list[PromptRow],
                reward: CombinedReward, *, accuracy_reward: str | None, num_records: int = 16,
                prefix: str = "eval", environment: bool = False,
                score: Callable[[list[PromptRow], list[list[Episode]]], RewardOutput] | None = None
                ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, records): the mean total reward, each function's mean, accuracy, response
    lengths, over all episodes (`generate` plays k per prompt row, `posttrain.rl.episodes`);
    with `environment` (a multi-turn environment) its reward is a component and its turn
    metrics are reported. Records hold the first episode of the first `num_records` rows with
    its scores (and its conversation when multi-turn), and that row's accuracy over all k
    episodes (`accuracy`), for paired comparisons of two models per prompt. `score(rows,
    groups)` replaces `score_episodes` (sequence RL: rewards over items)."""
    groups = generate(rows)
    if len(groups) != len(rows) or len({len(g) for g in groups}) != 1:
        raise RuntimeError(f"the engine returned {len(groups)} groups of completions for "
                           f"{len(rows)} prompts (k per prompt expected)")
    k = len(groups[0])
    episodes = [e for g in groups for e in g]
    out = (score(rows, groups) if score is not None
           else score_episodes(reward, rows, groups, environment=environment))
    n = len(episodes)
    metrics = {f"{prefix}/reward_mean": sum(out.total) / n, f"{prefix}/num_prompts": len(rows),
               f"{prefix}/samples_per_prompt": k,
               f"{prefix}/response_length_mean":
                   sum(len(e.completion_ids) for e in episodes) / n,
               f"{prefix}/truncated_fraction":
                   sum(e.finish_reason == "length" for e in episodes) / n}
    for name, values in out.components.items():
        metrics[f"{prefix}/{name}_mean"] = sum(values) / n
        metrics[f"{prefix}/{name}_failures"] = out.failures[name].count
    if environment:
        metrics.update({f"{prefix}/{key}": v for key, v in episode_metrics(episodes).items()})
    if accuracy_reward is not None:
        if accuracy_reward not in out.components:
            raise ValueError(f"eval.accuracy_reward {accuracy_reward!r} is not one of the "
                             f"configured rewards {sorted(out.components)}")
        metrics[f"{prefix}/accuracy"] = sum(out.components[accuracy_reward]) / n
    records = []
    for i in range(min(num_records, len(rows))):
        user = [m.get("content", "") for m in rows[i].messages if m.get("role") == "user"]
        j = i * k
        first = episodes[j]
        records.append({"prompt": user[-1] if user else "", "completion": first.answer,
                        "reward": out.total[j],
                        **({"conversation": _transcript(first), "turns": first.turns}
                           if environment else {}),
                        **({"accuracy": sum(out.components[accuracy_reward][j:j + k]) / k}
                           if accuracy_reward is not None else {}),
                        **{name: values[j] for name, values in out.components.items()},
                        **{k: v for k, v in rows[i].extras.items()
                           if isinstance(v, (str, int, float, bool))}})
    return metrics, records


def _transcript(episode: Episode) -> str:
    """The episode after its prompt, one ``[role] content`` block per message."""
    first = next(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
    return "\n".join(f"[{m['role']}] {m['content']}" for m in episode.messages[first:])
