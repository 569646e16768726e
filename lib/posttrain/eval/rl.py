"""Held-out reward evaluation for RL: generate completions for held-out prompts, score them.

Used by the GRPO controller (at the start, every K steps, at the end) and by the evaluate step
of `flows/grpo_flow.py` (the trained model against the starting one). The generator is any
rollout engine (`posttrain.rl.engine`); scores come from the same reward functions as training,
so "accuracy" is the mean of the configured 0/1 reward (exact match by default) over every
completion: with one greedy completion per prompt, greedy accuracy; with k sampled completions
per prompt, the mean@k accuracy RL papers report (the expected accuracy of one sample).
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.rl.engine import Rollout
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import CombinedReward

__all__ = ["prompt_columns", "reward_eval"]


def prompt_columns(rows: list[PromptRow]) -> dict[str, list[Any]]:
    """The extra dataset columns of the rows, one list per column (None where a row lacks it)."""
    names = sorted({k for r in rows for k in r.extras})
    return {k: [r.extras.get(k) for r in rows] for k in names}


def reward_eval(generate: Callable[[list[list[int]]], list[list[Rollout]]], rows: list[PromptRow],
                tokenizer: Any, reward: CombinedReward, *, accuracy_reward: str | None,
                num_records: int = 16, prefix: str = "eval") -> tuple[dict[str, float],
                                                                      list[dict[str, Any]]]:
    """(metrics, records): the mean total reward, each function's mean, accuracy, response
    lengths, over all completions (`generate` returns k per prompt); records hold the first
    completion of the first `num_records` prompts with its scores, and that prompt's accuracy
    over all k completions (`accuracy`), for paired comparisons of two models per prompt."""
    groups = generate([r.prompt_ids for r in rows])
    if len(groups) != len(rows) or len({len(g) for g in groups}) != 1:
        raise RuntimeError(f"the engine returned {len(groups)} groups of completions for "
                           f"{len(rows)} prompts (k per prompt expected)")
    k = len(groups[0])
    rollouts = [r for g in groups for r in g]
    texts = [tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
    columns = {name: [v for v in col for _ in range(k)]
               for name, col in prompt_columns(rows).items()}
    out = reward(texts, [r.messages for r in rows for _ in range(k)], columns)
    n = len(rollouts)
    metrics = {f"{prefix}/reward_mean": sum(out.total) / n, f"{prefix}/num_prompts": len(rows),
               f"{prefix}/samples_per_prompt": k,
               f"{prefix}/response_length_mean":
                   sum(len(r.completion_ids) for r in rollouts) / n,
               f"{prefix}/truncated_fraction":
                   sum(r.finish_reason == "length" for r in rollouts) / n}
    for name, values in out.components.items():
        metrics[f"{prefix}/{name}_mean"] = sum(values) / n
        metrics[f"{prefix}/{name}_failures"] = out.failures[name].count
    if accuracy_reward is not None:
        if accuracy_reward not in out.components:
            raise ValueError(f"eval.accuracy_reward {accuracy_reward!r} is not one of the "
                             f"configured rewards {sorted(out.components)}")
        metrics[f"{prefix}/accuracy"] = sum(out.components[accuracy_reward]) / n
    records = []
    for i in range(min(num_records, len(rows))):
        user = [m.get("content", "") for m in rows[i].messages if m.get("role") == "user"]
        j = i * k
        records.append({"prompt": user[-1] if user else "", "completion": texts[j],
                        "reward": out.total[j],
                        **({"accuracy": sum(out.components[accuracy_reward][j:j + k]) / k}
                           if accuracy_reward is not None else {}),
                        **{name: values[j] for name, values in out.components.items()},
                        **{k: v for k, v in rows[i].extras.items()
                           if isinstance(v, (str, int, float, bool))}})
    return metrics, records
