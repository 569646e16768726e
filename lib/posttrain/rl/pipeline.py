"""Asynchronous rollouts with bounded staleness: rollout batches produced ahead of the trainer.

With `rollout.max_staleness: k` (0 = the synchronous loop), while the trainer updates on the
batch of step s, the rollout engines already generate (and the controller scores) the batches of
steps s+1 .. s+k with the weights they hold. A batch produced while the engines hold the
weights of version v (the number of syncs so far) is trained at step s >= v with staleness
s - v <= k; the importance correction of the GRPO loss uses the engine's log-probs, so an
off-policy sample is weighted by pi_trainer / pi_engine (truncated at `algorithm.is_cap`).

    step s:  take batch s (wait if it is still being produced)
             start producing batches up to s+k   (a background thread; engines are busy)
             update on batch s -> sync the new weights (queued behind the engines' work)

Determinism. Production is a function of the step (prompts drawn from the one seeded stream,
in step order; sampling seeded by the step) and of the weights the engines hold when it starts,
which is fixed by the order above, so a run is reproducible for a given k.

Resume. A checkpoint taken after step s holds the trainer's weights of version s+1, but batches
s+1 .. s+k were (or are being) produced with older weights that no longer exist anywhere. So
`state()` waits for the batches in flight and returns them, serialised (token ids, log-probs,
rewards, and with routing replay each rollout's recorded experts as base64 int16: JSON, no
pickle); `restore()` puts them back. A restarted run then trains on exactly
the batches an uninterrupted run would have, neither losing nor repeating any.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from posttrain.rl.dynamic import GroupBatch
from posttrain.rl.episodes import Episode
from posttrain.rl.prompts import PromptRow
from posttrain.rl.rewards import RewardFailures, RewardOutput

__all__ = ["RolloutPipeline", "batch_from_json", "batch_to_json"]


class RolloutPipeline:
    """Batches of steps produced up to `max_staleness` steps ahead of the one being trained.

    `produce(step)` makes the batch of `step` (it draws prompts, generates and scores);
    `version()` is the policy version the engines hold (syncs so far). Every batch is
    stamped with the version it started from (`batch.metrics["rollout/policy_version"]`).
    Steps from `end` on are never produced. The caller must `wait()` before it changes the
    engines' weights: a batch is made with one version from its first token to its last.
    """

    def __init__(self, produce: Callable[[int], GroupBatch], version: Callable[[], int],
                 max_staleness: int, end: int | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.produce, self.version, self.max_staleness = produce, version, max_staleness
        self.end = end
        self._pending: dict[int, Future] = {}
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
                      if max_staleness else None)

    def _stamped(self, step: int, version: int) -> GroupBatch:
        batch = self.produce(step)
        batch.metrics["rollout/policy_version"] = float(version)
        return batch

    def take(self, step: int) -> GroupBatch:
        """The batch of `step` (produced now if nothing produced it ahead); then production of
        steps up to `step + max_staleness` starts in the background, in step order."""
        future = self._pending.pop(step, None)
        if future is not None:
            batch = future.result()
        else:
            batch = self._stamped(step, self.version())
        batch.metrics["rollout/staleness"] = float(
            step - batch.metrics["rollout/policy_version"])
        if self._pool is not None:
            last = step + self.max_staleness
            if self.end is not None:
                last = min(last, self.end - 1)
            for ahead in range(step + 1, last + 1):
                if ahead not in self._pending:
                    # the version is read now, before this step's update and sync
                    self._pending[ahead] = self._pool.submit(self._stamped, ahead,
                                                             self.version())
        return batch

    def wait(self) -> float:
        """Wait until no batch is being produced (before a weight sync); the seconds waited."""
        t0 = time.perf_counter()
        for future in self._pending.values():
            future.result()
        return time.perf_counter() - t0

    def state(self) -> list[dict[str, Any]]:
        """The batches produced ahead, waited for and serialised (for a checkpoint)."""
        return [{"step": step, "batch": batch_to_json(future.result())}
                for step, future in sorted(self._pending.items())]

    def restore(self, state: list[dict[str, Any]]) -> None:
        """Put back the batches of a checkpoint's `state()`."""
        assert not self._pending, "restore before the first take"
        for entry in state:
            future: Future = Future()
            future.set_result(batch_from_json(entry["batch"]))
            self._pending[int(entry["step"])] = future

    def close(self) -> None:
        if self._pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- serialisation

def batch_to_json(batch: GroupBatch) -> dict[str, Any]:
    """A produced batch as JSON-able data (floats round-trip exactly through JSON)."""
    return {"prompts": [dataclasses.asdict(p) for p in batch.prompts],
            "groups": [[_episode_to_json(r) for r in g] for g in batch.groups],
            "scored": {"total": batch.scored.total, "components": batch.scored.components,
                       "failures": {k: dataclasses.asdict(v)
                                    for k, v in batch.scored.failures.items()}},
            "metrics": batch.metrics}


def batch_from_json(data: dict[str, Any]) -> GroupBatch:
    scored = data["scored"]
    return GroupBatch(
        prompts=[PromptRow(**p) for p in data["prompts"]],
        groups=[[_episode_from_json(r) for r in g] for g in data["groups"]],
        scored=RewardOutput(total=list(scored["total"]),
                            components={k: list(v) for k, v in scored["components"].items()},
                            failures={k: RewardFailures(**v)
                                      for k, v in scored["failures"].items()}),
        metrics=dict(data["metrics"]))


def _episode_to_json(episode: Episode) -> dict[str, Any]:
    """The episode's fields; its routing record ([T, L, k] int16) as base64 bytes + shape."""
    routing = episode.routing
    out = dataclasses.asdict(dataclasses.replace(episode, routing=None))
    if routing is not None:
        data = routing.to(torch.int16).contiguous().numpy().astype("<i2").tobytes()
        out["routing"] = {"shape": list(routing.shape),
                          "int16_base64": base64.b64encode(data).decode("ascii")}
    return out


def _episode_from_json(data: dict[str, Any]) -> Episode:
    routing = data.get("routing")
    if routing is not None:
        raw = np.frombuffer(base64.b64decode(routing["int16_base64"]), dtype="<i2")
        routing = torch.from_numpy(raw.astype(np.int16)).view(routing["shape"])
    return Episode(**{**data, "routing": routing})
