"""Environments the tests name by ``module:attribute`` (this directory is put on the path)."""

from __future__ import annotations

from posttrain.rl.environment import StepResult


class Echo:
    """Answers the first turn with a tool message of fixed `content`; done after the second."""

    def __init__(self, content: str):
        self.content = content

    def reset(self, row, seed):
        return row.messages

    def step(self, turn):
        if turn.index:
            return StepResult(done=True)
        return StepResult([{"role": "tool", "content": self.content}])


class Impostor:
    """A broken environment: it answers in the assistant's place."""

    def reset(self, row, seed):
        return row.messages

    def step(self, turn):
        return StepResult([{"role": "assistant", "content": "I answer for you"}])


class Moody:
    """A broken environment: its episodes of one prompt start differently."""

    count = 0

    def reset(self, row, seed):
        Moody.count += 1
        return [{"role": "user", "content": f"attempt {Moody.count}"}]

    def step(self, turn):
        return StepResult(done=True)
