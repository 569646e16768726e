"""DAPO dynamic sampling and overlong shaping (`posttrain.rl.dynamic`)."""

from __future__ import annotations

import pytest

from posttrain.rl.dynamic import (DynamicSamplingConfig, OverlongConfig, overlong_penalty,
                                  round_seed, sample_groups)
from posttrain.rl.rewards import RewardFailures, RewardOutput

N = 4


def _world(rewards_by_prompt: dict[int, list[float]]):
    """A prompt stream 0, 1, 2, ... and a scorer giving prompt p the rewards listed for it
    (all zero when not listed); records what was drawn and each generation round."""
    state = {"next": 0, "rounds": [], "failures": 0}

    def next_prompts(k: int) -> list[int]:
        out = list(range(state["next"], state["next"] + k))
        state["next"] += k
        return out

    def generate(prompts: list[int], round_index: int) -> list[list[tuple[int, int]]]:
        state["rounds"].append((round_index, list(prompts)))
        return [[(p, i) for i in range(N)] for p in prompts]

    def score(prompts: list[int], groups: list[list[tuple[int, int]]]) -> RewardOutput:
        total = [r for p in prompts for r in rewards_by_prompt.get(p, [0.0] * N)]
        return RewardOutput(total=total, components={"r": list(total)},
                            failures={"r": RewardFailures(1, "boom")})

    return state, next_prompts, generate, score


SIGNAL = [1.0, 0.0, 0.0, 1.0]


def test_without_dynamic_sampling_one_round_keeps_every_group():
    state, *fns = _world({1: SIGNAL})
    batch = sample_groups(3, N, *fns, None)
    assert batch.prompts == [0, 1, 2] and state["rounds"] == [(0, [0, 1, 2])]
    assert batch.metrics == {}
    assert batch.scored.total == [0.0] * 4 + SIGNAL + [0.0] * 4


def test_groups_without_variance_are_replaced_by_new_prompts():
    # prompts 1, 3, 4, 6 have signal; 0, 2, 5 all-equal rewards
    state, *fns = _world({1: SIGNAL, 3: SIGNAL, 4: [0.5, 0.5, 0.5, 0.0], 6: SIGNAL})
    batch = sample_groups(3, N, *fns, DynamicSamplingConfig(max_rounds=4))
    # round 0 draws 3 (keeps 1), round 1 draws 2 more (keeps 3, 4): done
    assert state["rounds"] == [(0, [0, 1, 2]), (1, [3, 4])]
    assert batch.prompts == [1, 3, 4]
    assert batch.groups[1] == [(3, i) for i in range(N)]
    assert batch.scored.total == SIGNAL + SIGNAL + [0.5, 0.5, 0.5, 0.0]
    assert batch.scored.components["r"] == batch.scored.total
    assert batch.scored.failures["r"] == RewardFailures(2, "boom")   # over both rounds
    assert batch.metrics == {"dynamic_sampling/rounds": 2.0,
                             "dynamic_sampling/filtered_groups": 2.0,
                             "dynamic_sampling/filler_groups": 0.0,
                             "dynamic_sampling/sampled_groups": 5.0}


def test_after_max_rounds_the_batch_is_filled_with_the_first_filtered_groups():
    state, *fns = _world({2: SIGNAL})
    batch = sample_groups(3, N, *fns, DynamicSamplingConfig(max_rounds=2))
    assert state["rounds"] == [(0, [0, 1, 2]), (1, [3, 4])]
    assert batch.prompts == [2, 0, 1]            # kept first, then the earliest filtered
    assert batch.metrics["dynamic_sampling/filler_groups"] == 2.0
    assert batch.metrics["dynamic_sampling/filtered_groups"] == 4.0


def test_round_seeds_keep_round_zero_and_differ_across_steps_and_rounds():
    assert round_seed(17, 0) == 17
    seeds = {round_seed(step, r) for step in range(100) for r in range(4)}
    assert len(seeds) == 400


@pytest.mark.parametrize("length, expected", [(0, 0.0), (40, 0.0), (41, -0.125), (44, -0.5),
                                              (48, -1.0)])
def test_overlong_penalty_is_dapos_soft_punishment(length, expected):
    # budget 48, buffer 8: free up to 40 tokens, then linear to -penalty at 48
    assert overlong_penalty(length, 48, OverlongConfig(buffer_tokens=8)) == pytest.approx(expected)
    assert overlong_penalty(length, 48, OverlongConfig(buffer_tokens=8, penalty=0.5)) == (
        pytest.approx(expected / 2))


def test_configs_validate():
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSamplingConfig(max_rounds=0)
    with pytest.raises(ValueError, match="buffer_tokens"):
        OverlongConfig(buffer_tokens=0)
