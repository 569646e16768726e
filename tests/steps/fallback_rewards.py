"""Toy GRPO rewards for tests/steps/test_fallback_rl.py (named there as
``tests.steps.fallback_rewards:<function>``; the run's working directory is the repository)."""

from __future__ import annotations

import random
import zlib

VOWELS = frozenset("aeiouAEIOU")


def vowels(completions: list[str], prompts: list[list[dict]], columns: dict) -> list[float]:
    """The fraction of a completion's characters that are vowels (a random tiny model starts
    near 0.08: the bundled tokenizer is mostly digits and symbols)."""
    return [sum(c in VOWELS for c in text) / max(len(text), 1) for text in completions]


def shuffled_vowels(completions: list[str], prompts: list[list[dict]], columns: dict
                    ) -> list[float]:
    """`vowels`, permuted over the batch: the batch mean is the policy's true mean reward, but
    which completion gets which reward carries no information (the control). The permutation
    is seeded by the batch's text, so a resumed run draws the same one."""
    rewards = vowels(completions, prompts, columns)
    random.Random(zlib.crc32("\x00".join(completions).encode())).shuffle(rewards)
    return rewards
