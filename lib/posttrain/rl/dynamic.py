"""DAPO's dynamic sampling and overlong reward shaping (Yu et al. 2025, arXiv:2503.14476).

**Dynamic sampling** (DAPO sec. 3.2). A group whose samples all got the same reward has zero
group-relative advantage, so it contributes no gradient and only dilutes the batch. With
`dynamic_sampling.max_rounds: R`, a step keeps the groups with reward variance and, while fewer
than `prompts_per_step` are kept, draws that many more prompts from the stream and samples them
again, for at most R rounds of generation (the first included). If the batch is still short
after R rounds, it is filled with the earliest filtered groups (advantage 0: they add no
gradient, but keep the batch the configured size); the metrics say how many groups were filtered,
how many rounds ran and how many filler groups went in. Every round draws prompts from the same
checkpointed stream and samples with a seed derived from (step, round), so a resumed run draws
and samples exactly what an uninterrupted one did.

**Overlong shaping** (DAPO sec. 3.4, "soft overlong punishment"). With
`overlong.buffer_tokens: B` and a budget of L = `sampling.max_new_tokens`, a completion of
length n gets, added to its reward,

    0                               n <= L - B
    ((L - B) - n) / B * penalty     L - B < n <= L

so the penalty grows linearly to -penalty at the budget (a truncated completion has n = L).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from posttrain.rl.rewards import RewardFailures, RewardOutput

__all__ = ["DynamicSamplingConfig", "GroupBatch", "OverlongConfig", "overlong_penalty",
           "round_seed", "sample_groups"]

# round r > 0 of a step samples with seed + r * stride (round 0 keeps the step's seed)
_ROUND_SEED_STRIDE = 1_000_000_007


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """Keep only groups with reward variance; `max_rounds` rounds of generation at most."""

    max_rounds: int = 4

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"dynamic_sampling.max_rounds must be >= 1, got {self.max_rounds}")


@dataclass(frozen=True)
class OverlongConfig:
    """Soft overlong punishment over the last `buffer_tokens` of the generation budget."""

    buffer_tokens: int
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer_tokens < 1:
            raise ValueError(f"overlong.buffer_tokens must be >= 1, got {self.buffer_tokens}")
        if self.penalty < 0:
            raise ValueError(f"overlong.penalty must be >= 0, got {self.penalty}")


def overlong_penalty(length: int, max_new_tokens: int, cfg: OverlongConfig) -> float:
    """The reward added to a completion of `length` tokens (0 or negative; module docstring)."""
    start = max_new_tokens - cfg.buffer_tokens
    if length <= start:
        return 0.0
    return -cfg.penalty * min(length - start, cfg.buffer_tokens) / cfg.buffer_tokens


def round_seed(step_seed: int, round_index: int) -> int:
    """The sampling seed of generation round `round_index` of a step seeded `step_seed`."""
    return (step_seed + round_index * _ROUND_SEED_STRIDE) % (2 ** 63)


@dataclass
class GroupBatch:
    """The groups a step trains on, in order: their prompts, rollouts (n per prompt) and the
    rewards of those rollouts; plus what dynamic sampling did."""

    prompts: list[Any]
    groups: list[list[Any]]
    scored: RewardOutput
    metrics: dict[str, float] = field(default_factory=dict)


def sample_groups(want: int, n: int, next_prompts: Callable[[int], list[Any]],
                  generate: Callable[[list[Any], int], list[list[Any]]],
                  score: Callable[[list[Any], list[list[Any]]], RewardOutput],
                  dynamic: DynamicSamplingConfig | None) -> GroupBatch:
    """`want` groups of `n` rollouts: one round without `dynamic`, else rounds until `want`
    groups with reward variance are kept (see the module docstring).

    `next_prompts(k)` draws k prompts, `generate(prompts, round)` samples n rollouts of each,
    `score(prompts, groups)` rewards them (n per group, in order).
    """
    kept: list[tuple[Any, list[Any], RewardOutput, int]] = []
    filtered: list[tuple[Any, list[Any], RewardOutput, int]] = []
    outputs: list[RewardOutput] = []
    rounds = 0
    max_rounds = dynamic.max_rounds if dynamic is not None else 1
    while len(kept) < want and rounds < max_rounds:
        prompts = next_prompts(want - len(kept))
        groups = generate(prompts, rounds)
        scored = score(prompts, groups)
        outputs.append(scored)
        for g, (prompt, group) in enumerate(zip(prompts, groups)):
            entry = (prompt, group, scored, g)
            totals = scored.total[g * n:(g + 1) * n]
            (kept if dynamic is None or max(totals) > min(totals) else filtered).append(entry)
        rounds += 1
    filler = filtered[:want - len(kept)]
    chosen = kept + filler
    metrics: dict[str, float] = {}
    if dynamic is not None:
        metrics = {"dynamic_sampling/rounds": float(rounds),
                   "dynamic_sampling/filtered_groups": float(len(filtered)),
                   "dynamic_sampling/filler_groups": float(len(filler)),
                   "dynamic_sampling/sampled_groups": float(len(kept) + len(filtered))}
    return GroupBatch(prompts=[c[0] for c in chosen], groups=[c[1] for c in chosen],
                      scored=_select(chosen, n, outputs), metrics=metrics)


def _select(chosen: Sequence[tuple[Any, list[Any], RewardOutput, int]], n: int,
            outputs: Sequence[RewardOutput]) -> RewardOutput:
    """The rewards of the chosen groups, in their order; failures counted over every scored
    sample (a function that failed on a dropped group still failed)."""
    def rows(out: RewardOutput, values: list[float], g: int) -> list[float]:
        return values[g * n:(g + 1) * n]

    total = [v for _, _, out, g in chosen for v in rows(out, out.total, g)]
    names = list(outputs[0].components)
    components = {name: [v for _, _, out, g in chosen for v in rows(out, out.components[name], g)]
                  for name in names}
    failures = {}
    for name in names:
        count = sum(o.failures[name].count for o in outputs)
        first = next((o.failures[name].first_error for o in outputs
                      if o.failures[name].first_error), None)
        failures[name] = RewardFailures(count, first)
    return RewardOutput(total=total, components=components, failures=failures)
