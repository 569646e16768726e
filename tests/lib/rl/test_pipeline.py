"""Asynchronous rollouts (`posttrain.rl.pipeline`): order, staleness, checkpointed buffers."""

from __future__ import annotations

import json
import threading

import pytest

from posttrain.rl.dynamic import GroupBatch
from posttrain.rl.episodes import Episode
from posttrain.rl.pipeline import RolloutPipeline, batch_from_json, batch_to_json
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import RewardFailures, RewardOutput


class _World:
    """A fake controller: `produce(step)` records (step, engine version, thread) and returns a
    batch whose numbers depend on both; `sync()` bumps the engines' version."""

    def __init__(self):
        self.versions, self.produced = 0, []

    def produce(self, step: int) -> GroupBatch:
        self.produced.append((step, self.versions, threading.current_thread().name))
        rollout = Episode([1, 2], [3, step], [-0.25, -1.0 / 3 - step], "stop", loss_mask=[1, 1],
                          messages=[{"role": "assistant", "content": f"a{step}"}],
                          answer=f"a{step}", env_reward=0.1 * step, turns=1,
                          metrics={"tool_calls": 1.0})
        prompt = PromptRow([1, 2], [{"role": "user", "content": f"q{step}"}], {"answer": step})
        scored = RewardOutput([float(step)], {"r": [float(step)]}, {"r": RewardFailures(0)})
        return GroupBatch([prompt], [[rollout]], scored, {"dynamic_sampling/rounds": 1.0})

    def sync(self) -> None:
        self.versions += 1


def _train(world: _World, pipeline: RolloutPipeline, steps: range) -> list[tuple]:
    seen = []
    for step in steps:
        batch = pipeline.take(step)
        seen.append((step, batch.groups[0][0].completion_ids[1],
                     batch.metrics["rollout/policy_version"], batch.metrics["rollout/staleness"]))
        pipeline.wait()                                      # the update; nothing in flight
        world.sync()                                         # then the sync
    return seen


def test_synchronous_pipeline_produces_each_step_on_its_own_weights():
    world = _World()
    seen = _train(world, RolloutPipeline(world.produce, lambda: world.versions, 0), range(3))
    assert seen == [(0, 0, 0.0, 0.0), (1, 1, 1.0, 0.0), (2, 2, 2.0, 0.0)]
    assert all(t == threading.main_thread().name for *_, t in world.produced)


@pytest.mark.parametrize("k", [1, 2])
def test_batches_are_produced_ahead_with_bounded_staleness(k):
    world = _World()
    pipeline = RolloutPipeline(world.produce, lambda: world.versions, k)
    seen = _train(world, pipeline, range(6))
    pipeline.close()
    assert [s[1] for s in seen] == list(range(6))           # every step's own batch, in order
    staleness = [s[3] for s in seen]
    assert staleness[0] == 0 and max(staleness) == k and all(0 <= x <= k for x in staleness)
    produced = sorted(world.produced)
    steps = [p[0] for p in produced]
    assert len(set(steps)) == len(steps) and set(range(6)) <= set(steps)   # none twice
    assert all(t.startswith("rollouts") for s, _, t in produced if s > 0)


def test_nothing_is_produced_past_the_end_and_wait_leaves_nothing_in_flight():
    world = _World()
    pipeline = RolloutPipeline(world.produce, lambda: world.versions, 2, end=4)
    seen = _train(world, pipeline, range(4))
    pipeline.close()
    assert sorted(p[0] for p in world.produced) == [0, 1, 2, 3]
    assert [(s[0], s[2]) for s in seen] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0)]
    # each batch was made with the weights of the version it is stamped with: no sync ran
    # while one was in flight
    assert sorted((p[0], float(p[1])) for p in world.produced) == [(s[0], s[2]) for s in seen]


def test_checkpointed_buffer_resumes_exactly():
    """Steps 0-2, a checkpoint (the batches produced ahead, serialised), a new pipeline
    restored from it: the rest equals an uninterrupted run."""
    k = 2
    world = _World()
    whole = _train(world, RolloutPipeline(world.produce, lambda: world.versions, k), range(6))

    world = _World()
    first = RolloutPipeline(world.produce, lambda: world.versions, k)
    head = _train(world, first, range(3))
    state = json.loads(json.dumps(first.state()))              # what a checkpoint holds
    first.close()
    assert [e["step"] for e in state] == [3, 4]
    resumed = RolloutPipeline(world.produce, lambda: world.versions, k)
    resumed.restore(state)
    tail = _train(world, resumed, range(3, 6))
    resumed.close()
    assert head + tail == whole


def test_batch_json_round_trip_is_exact():
    batch = _World().produce(7)
    again = batch_from_json(json.loads(json.dumps(batch_to_json(batch))))
    assert again == batch
