"""The bundled GRPO reward functions, registered by name (`posttrain.rl.reward_registry`)
when `posttrain.rl.rewards` is imported:

| name | reward |
|---|---|
| ``exact_match_number`` | 1.0 where the completion's final number equals a column's |
| ``numeric_closeness`` | ``scale / (scale + |final number - answer|)``: partial credit |
| ``format`` | 1.0 where the completion matches a regex (default: ends in "The answer is N.") |
| ``length_penalty`` | minus a penalty per character (or token) over a target length |
| ``python_exec`` | 1.0 where the last code block, run in the sandbox, prints a column's value |

and `parse_number`, the final answer of a text as an exact number, which evaluation and
environments read answers with too.
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any, Literal

from posttrain.rl.reward_registry import column_param, register
from posttrain.rl.sandbox import IsolationMode, SandboxLimits, require_isolation, run_python

__all__ = ["DEFAULT_FORMAT", "exact_match_number", "extract_code", "format_reward",
           "length_penalty", "numeric_closeness", "parse_number", "python_exec"]

def _column(columns: dict[str, list[Any]], name: str) -> list[Any]:
    if name not in columns:
        raise KeyError(f"the dataset has no column {name!r} (columns: {sorted(columns)}); set "
                       "the reward's `column` param")
    return columns[name]


# A number: optional sign (not when glued to a preceding word, so "3-5" is 3 and 5), digits with
# optional thousands commas, optional decimals. "−" is the Unicode minus some models emit.
_NUMBER = r"(?:(?<![\w.])[-−])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_RE = re.compile(r"answer\s+is\s*[:=]?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The final answer in `text`: the last "The answer is N", else the last number; None if
    there is none. Exact (a Fraction), so 1,234 == 1234 == 1234.0."""
    found = _ANSWER_RE.findall(text)
    token = found[-1] if found else (_NUMBER_RE.findall(text) or [None])[-1]
    if token is None:
        return None
    return Fraction(re.sub(r"[,\s]", "", token).replace("−", "-"))


def _numbers(completions: list[str], columns: dict[str, list[Any]], column: str
             ) -> list[tuple[Fraction | None, Fraction]]:
    """(the completion's final number, or None; `column`'s number) of each sample; a column
    value that is not a number raises."""
    out = []
    for completion, answer in zip(completions, _column(columns, column)):
        expected = parse_number(str(answer))
        if expected is None:
            raise ValueError(f"column {column!r} value {answer!r} is not a number")
        out.append((parse_number(completion), expected))
    return out


@register("exact_match_number", columns=column_param)
def exact_match_number(completions: list[str], prompts: list[list[dict]],
                       columns: dict[str, list[Any]], *, column: str = "answer") -> list[float]:
    """1.0 where the completion's final number equals `column`'s number, else 0.0."""
    del prompts
    return [1.0 if got is not None and got == expected else 0.0
            for got, expected in _numbers(completions, columns, column)]


def _validate_closeness(*, column: str = "answer", scale: float = 1.0) -> None:
    del column
    if not scale > 0:
        raise ValueError(f"params.scale must be > 0, got {scale}")


@register("numeric_closeness", validate=_validate_closeness, columns=column_param)
def numeric_closeness(completions: list[str], prompts: list[list[dict]],
                      columns: dict[str, list[Any]], *, column: str = "answer",
                      scale: float = 1.0) -> list[float]:
    """Partial credit for a near miss: ``scale / (scale + |final number - answer|)`` (1.0 when
    exact, 0.5 at a distance of `scale`), 0.0 without a number. A dense, shaped companion of
    `exact_match_number` for numeric tasks: every sample of a group is ranked by how close it
    came, not only the rare exact ones."""
    del prompts
    return [0.0 if got is None else scale / (scale + float(abs(got - expected)))
            for got, expected in _numbers(completions, columns, column)]


DEFAULT_FORMAT = r"The answer is " + _NUMBER + r"\.?\s*$"


def _validate_format(*, pattern: str = DEFAULT_FORMAT, full_match: bool = False) -> None:
    del full_match
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"params.pattern {pattern!r} is not a valid regex: {e}") from None


@register("format", validate=_validate_format)
def format_reward(completions: list[str], prompts: list[list[dict]],
                  columns: dict[str, list[Any]], *, pattern: str = DEFAULT_FORMAT,
                  full_match: bool = False) -> list[float]:
    """1.0 where the completion matches `pattern` (``re.search``, or ``re.fullmatch`` when
    `full_match`; DOTALL, MULTILINE off), else 0.0. The default wants a completion that ends
    with "The answer is N." as the SFT data does."""
    del prompts, columns
    regex = re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if full_match else regex.search
    return [1.0 if match(c) else 0.0 for c in completions]


@functools.cache
def _tokenizer(path: str) -> Any:
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    return ChatTokenizer(TokenizerConfig(path=path))


def _validate_length(*, target_length: int, penalty_per_unit: float = 1e-3,
                     max_penalty: float | None = None,
                     unit: Literal["chars", "tokens"] = "chars",
                     tokenizer: str | None = None) -> None:
    if not isinstance(target_length, int) or target_length < 0:
        raise ValueError(f"params.target_length must be an integer >= 0, got {target_length!r}")
    if penalty_per_unit < 0 or (max_penalty is not None and max_penalty < 0):
        raise ValueError("params.penalty_per_unit and params.max_penalty must be >= 0 "
                         "(the reward is minus the penalty)")
    if unit not in ("chars", "tokens"):
        raise ValueError(f"params.unit {unit!r} is not one of ['chars', 'tokens']")
    if unit == "tokens" and tokenizer is None:
        raise ValueError("params.unit 'tokens' needs params.tokenizer (a tokenizer dir)")
    if unit == "chars" and tokenizer is not None:
        raise ValueError("params.tokenizer is only used with unit: tokens")


@register("length_penalty", validate=_validate_length)
def length_penalty(completions: list[str], prompts: list[list[dict]],
                   columns: dict[str, list[Any]], *, target_length: int,
                   penalty_per_unit: float = 1e-3, max_penalty: float | None = None,
                   unit: Literal["chars", "tokens"] = "chars",
                   tokenizer: str | None = None) -> list[float]:
    """``-penalty_per_unit * max(0, length - target_length)``, capped at ``-max_penalty``;
    length in characters, or in tokens of the tokenizer at `tokenizer` (no special tokens)."""
    del prompts, columns
    if unit == "tokens":
        tok = _tokenizer(str(tokenizer))
        lengths = [len(tok.encode_text(c)) for c in completions]
    else:
        lengths = [len(c) for c in completions]
    out = []
    for length in lengths:
        penalty = penalty_per_unit * max(0, length - target_length)
        out.append(-(min(penalty, max_penalty) if max_penalty is not None else penalty))
    return out


_CODE_BLOCK_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The last fenced code block (```python or bare ```), or None."""
    blocks = _CODE_BLOCK_RE.findall(completion)
    return blocks[-1] if blocks else None


def _validate_python_exec(*, column: str = "expected_stdout", timeout_s: float = 5.0,
                          cpu_s: int = 5, memory_mb: int = 512, max_workers: int = 0,
                          isolation: IsolationMode = "required") -> None:
    del column
    if max_workers < 0:
        raise ValueError("params.max_workers must be >= 0 (0: one per CPU core)")
    _limits(timeout_s, cpu_s, memory_mb, isolation)
    require_isolation(isolation, "rewards.functions[python_exec].params.isolation")


def _limits(timeout_s: float, cpu_s: int, memory_mb: int,
            isolation: IsolationMode) -> SandboxLimits:
    return SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_bytes=memory_mb * 2**20,
                         isolation=isolation)


@register("python_exec", validate=_validate_python_exec, columns=column_param)
def python_exec(completions: list[str], prompts: list[list[dict]],
                columns: dict[str, list[Any]], *, column: str = "expected_stdout",
                timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512,
                max_workers: int = 0, isolation: IsolationMode = "required") -> list[float]:
    """1.0 where the completion's last code block, run in the sandbox (`posttrain.rl.sandbox`),
    exits cleanly and prints `column`'s value (both stripped of surrounding whitespace).

    The example of a reward that executes model output: the code is untrusted, so it never runs
    in this process, and by default only in an isolated sandbox (a config without one fails
    at launch; ``isolation: weak`` accepts rlimits and the audit hook alone). No code block, a
    crash, a timeout or a blocked network call score 0.
    """
    del prompts
    expected = _column(columns, column)
    limits = _limits(timeout_s, cpu_s, memory_mb, isolation)

    def one(i: int) -> float:
        code = extract_code(completions[i])
        if code is None:
            return 0.0
        result = run_python(code, limits)
        return 1.0 if result.ok and result.stdout.strip() == str(expected[i]).strip() else 0.0

    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(completions)))) as pool:
        return list(pool.map(one, range(len(completions))))
