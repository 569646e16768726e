"""An engine and a reward of the tests' own for tests/steps/test_train_sequence_rl.py, named
there as ``tests.steps.sequence_rl_parts:<name>`` (the runs' working directory is the
repository, as a user's own modules would be on their path)."""

from __future__ import annotations

import random
import zlib
from typing import Any

from posttrain.rl.factory import native_engine
from posttrain.rl.items import synthetic_dwell


class CountingEngine:
    """A rollout engine of one's own (``rollout.kind: module:Class``): it wraps the native
    engine, as a custom engine might wrap a server, and counts the completions it made."""

    generated = 0                       # completions made in this process, by any instance

    def __init__(self, *, args: Any, hf_dir: str, device: Any, dtype: Any, seed: int,
                 max_batch_sequences: int = 256):
        self.inner = native_engine(args, device, dtype, seed,
                                   max_batch_sequences=max_batch_sequences)
        self.parameter_shapes = self.inner.parameter_shapes
        self.dtype = self.inner.dtype
        self.partial_updates = self.inner.partial_updates

    def generate(self, prompts, sampling, n=1):
        out = self.inner.generate(prompts, sampling, n)
        type(self).generated += sum(len(group) for group in out)
        return out

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)

    def logprobs(self, sequences, prompt_lens, *, temperature=1.0, allowed_token_ranges=()):
        return self.inner.logprobs(sequences, prompt_lens, temperature=temperature,
                                   allowed_token_ranges=allowed_token_ranges)

    def release_memory(self) -> bool:
        return self.inner.release_memory()

    def resume_memory(self) -> None:
        self.inner.resume_memory()


def shuffled_dwell(completions: list[list], histories: list[list], columns: dict,
                   **params: Any) -> list[float]:
    """`synthetic_dwell`, permuted over the batch: the batch mean is the policy's true mean
    reward, but which completion gets which reward carries no information (the control). The
    permutation is seeded by the batch's items, so a resumed run draws the same one."""
    rewards = synthetic_dwell(completions, histories, columns, **params)
    random.Random(zlib.crc32(repr(completions).encode())).shuffle(rewards)
    return rewards
