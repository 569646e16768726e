"""Standard benchmark scoring: GSM8K answers, pass@k, multiple choice by log-likelihood.

The parts behind three options of the evaluation suites (`posttrain.eval.suites`):

**GSM8K answers** (grader ``gsm8k`` of the ``generation`` kind). lm-eval-harness's ``gsm8k``
task keeps two answers per generation, and this grader reads them the same way:

* ``strict``: the first match of ``#### (\\-?[0-9\\.\\,]+)`` (its "strict-match" filter);
* ``flexible``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` (its "flexible-extract"
  filter: ``group_select: -1``, the non-empty group);
* ``auto`` (the default): strict when the answer has a ``#### N`` marker, else flexible.

The kept text is normalized as lm-eval's ``exact_match`` does with the task's
``regexes_to_ignore`` (``,``, ``$``, everything up to ``#### ``, one trailing ``.``), so
``$1,000.`` gives ``1000``. The reference goes through the same steps in ``auto`` mode, so it
may be a bare number or a whole GSM8K solution ending in ``#### 72``. Where lm-eval then
compares the two strings (``72.0`` != ``72``), this grader compares them as exact numbers
(fractions): ``72.0`` == ``72``; text that is not a number after normalization (``1.2.3``)
scores 0, as lm-eval's string would not match the reference's number.

**pass@k** (``pass_at_k: [1, 4]`` of a ``generation`` task with ``samples_per_prompt`` n >= k,
Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): per problem with c of its
n samples correct, the unbiased estimator

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(the product form is the paper's numerically stable one; 1 when n - c < k), averaged over the
problems. pass@1 equals the mean accuracy of the samples.

**Multiple choice** (kind ``multiple_choice``, MMLU / ARC / HellaSwag style, as lm-eval's
``multiple_choice`` output type): each row has a question, a list of options and the gold one;
every option's continuation is scored by the sum of its tokens' log-probs given the context,
through the packed native log-prob path of the other scoring kinds
(`posttrain.eval.heldout.sequence_logps`). With ll_j the sum for option j and len_j the length
of its continuation text in characters (without the delimiter; lm-eval's ``acc_norm``, equal to
its length in bytes for ASCII text):

    accuracy      = mean over rows of [argmax_j ll_j == gold]
    accuracy_norm = mean over rows of [argmax_j ll_j / len_j == gold]

The first option wins a tie (numpy's argmax). The context is the row rendered by `template`
(``{question}``; ``{choices}``: the options as lines ``A. ...``), either as plain text (the
continuation is `target_delimiter` + option, default ``" "``, tokenized as lm-eval does: the
whole text, minus the context's tokens, trailing spaces of the context moved to the
continuation) or as one user turn through the chat template with its generation prompt (the
continuation is the option's tokens, no delimiter, as lm-eval does with ``--apply_chat_template``).
The continuation is the option's text, or its letter (``continuation: letter``, MMLU's
``A``/``B``/``C``/``D`` after ``{choices}`` in the prompt).

Row shapes read without any column names set (the first column found is used): the question
from ``question``, ``ctx``, ``query`` or ``context``; the options from ``choices``, ``endings``
or ``options``, a list of strings or ARC's ``{"text": [...], "label": [...]}``; the gold from
``answer``, ``label``, ``answerKey`` or ``gold``: a 0-based index (an int or a string of digits:
HellaSwag's ``"2"``), one of the options' labels (ARC's ``"B"`` or ``"3"``), or a letter
(``"C"`` = index 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Literal

from posttrain.errors import DataError
from posttrain.eval.heldout import sequence_logps

__all__ = ["ChoiceConfig", "ChoiceRow", "check_pass_at_k", "choice_reader", "choice_scores",
           "encode_choices", "extract_gsm8k", "gsm8k_number", "parse_choice_row", "pass_at_k",
           "pass_at_k_metrics"]

GSM8KMode = Literal["auto", "strict", "flexible"]

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = [re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$")]
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")


# --------------------------------------------------------------------------- GSM8K


def extract_gsm8k(text: str, mode: GSM8KMode = "auto") -> str | None:
    """The answer lm-eval's gsm8k filters keep from `text`, normalized (module docstring);
    None when the mode's pattern does not match."""
    if mode != "flexible":
        strict = _STRICT.search(text)           # take_first
        if strict is not None:
            return _normalize(strict.group(1))
        if mode == "strict":
            return None
    found = _FLEXIBLE.findall(text)
    if not found:
        return None
    return _normalize(next(g for g in found[-1] if g))


def _normalize(token: str) -> str:
    token = token.strip()
    for pattern in _IGNORED:
        token = pattern.sub("", token)
    return token.strip()


def gsm8k_number(text: str, mode: GSM8KMode = "auto") -> Fraction | None:
    """The extracted answer as an exact number; None without one or when it is not a
    number."""
    token = extract_gsm8k(text, mode)
    if token is None or not _NUMBER.fullmatch(token):
        return None
    return Fraction(token)


# --------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` of `n` samples correct (module docstring)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def check_pass_at_k(ks: tuple[int, ...], n: int) -> None:
    """A task's `pass_at_k` list against its n samples per problem (ValueError naming it)."""
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"pass_at_k: k={k} needs 1 <= k <= generation.samples_per_prompt "
                             f"(n = {n} samples per problem); sample more (with temperature > "
                             "0) or drop it")
    if len(set(ks)) != len(ks):
        raise ValueError(f"pass_at_k: {list(ks)} lists a k twice")


def pass_at_k_metrics(correct: list[int], n: int, ks: tuple[int, ...]) -> dict[str, float]:
    """``pass@k`` for each k: the mean over problems of `pass_at_k` (`correct`: c per problem,
    of n samples each)."""
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks}


# --------------------------------------------------------------------------- multiple choice


QUESTION_COLUMNS = ("question", "ctx", "query", "context")
CHOICES_COLUMNS = ("choices", "endings", "options")
ANSWER_COLUMNS = ("answer", "label", "answerKey", "gold")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class ChoiceConfig:
    """Where a multiple-choice row's parts are and how its options are scored (module
    docstring); a column left None is the first of the common names the row has."""

    question_column: str | None = None
    choices_column: str | None = None
    answer_column: str | None = None
    prompt: Literal["plain", "chat"] = "plain"     # the context as text or a chat user turn
    template: str = "{question}"                    # e.g. "Question: {question}\nAnswer:"
    continuation: Literal["text", "letter"] = "text"   # letter: MMLU's " A" after {choices}
    target_delimiter: str | None = None             # before each option; " " plain, "" chat

    def __post_init__(self) -> None:
        if "{question}" not in self.template:
            raise ValueError(f"template: {self.template!r} must contain {{question}}")
        if self.continuation == "letter" and "{choices}" not in self.template:
            raise ValueError("continuation: letter scores the options' letters, so template "
                             "must list the options with {choices}")

    @property
    def delimiter(self) -> str:
        if self.target_delimiter is not None:
            return self.target_delimiter
        return " " if self.prompt == "plain" else ""


@dataclass
class ChoiceRow:
    """One multiple-choice row: the rendered context, the options, what is scored for each
    (its text or its letter; after `delimiter`), and the gold option's index."""

    question: str
    choices: list[str]
    gold: int
    context: str
    scored: list[str]
    delimiter: str = " "

    @property
    def continuations(self) -> list[str]:
        return [self.delimiter + s for s in self.scored]

    def describe(self) -> dict[str, Any]:
        return {"prompt": self.question, "reference": self.choices[self.gold], "gold": self.gold}


def _column(row: dict, configured: str | None, candidates: tuple[str, ...], key: str,
            file: str | None, line: int | None) -> str:
    if configured is not None:
        if configured not in row:
            raise DataError(f"missing required field (row has: {', '.join(sorted(row))}; set "
                            f"multiple_choice.{key})", file=file, line=line, field=configured,
                            reason="missing_field")
        return configured
    for name in candidates:
        if name in row:
            return name
    raise DataError(f"no {key.split('_')[0]} column: the row has {', '.join(sorted(row))}, none "
                    f"of {', '.join(candidates)} (set multiple_choice.{key})", file=file,
                    line=line, field=candidates[0], reason="missing_field")


def parse_choice_row(row: Any, cfg: ChoiceConfig, *, file: str | None = None,
                     line: int | None = None) -> ChoiceRow:
    """Validate one multiple-choice row and render its context and continuations; a bad row
    raises DataError naming file, line and field."""
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object, got {type(row).__name__}", file=file,
                        line=line, field="<row>", reason="not_an_object")

    def fail(field: str, message: str, reason: str = "wrong_type") -> DataError:
        return DataError(message, file=file, line=line, field=field, reason=reason)

    q_col = _column(row, cfg.question_column, QUESTION_COLUMNS, "question_column", file, line)
    c_col = _column(row, cfg.choices_column, CHOICES_COLUMNS, "choices_column", file, line)
    a_col = _column(row, cfg.answer_column, ANSWER_COLUMNS, "answer_column", file, line)
    question, raw_choices, answer = row[q_col], row[c_col], row[a_col]
    if not isinstance(question, str) or not question.strip():
        raise fail(q_col, f"must be a non-empty string, got {question!r}")
    labels: list[str] | None = None
    if isinstance(raw_choices, dict):           # ARC: {"text": [...], "label": [...]}
        if not {"text", "label"} <= set(raw_choices):
            raise fail(c_col, f"a mapping of options needs 'text' and 'label' lists, has "
                       f"{sorted(raw_choices)}")
        labels = [str(x) for x in raw_choices["label"]]
        raw_choices = raw_choices["text"]
        if not isinstance(raw_choices, list) or len(labels) != len(raw_choices):
            raise fail(c_col, "'text' and 'label' must be lists of the same length")
    if (not isinstance(raw_choices, list) or len(raw_choices) < 2
            or not all(isinstance(x, str) and x for x in raw_choices)):
        raise fail(c_col, f"must be a list of at least 2 non-empty strings, got {raw_choices!r}")
    choices = list(raw_choices)
    gold = _gold(answer, choices, labels, a_col, fail)
    if cfg.continuation == "letter" and len(choices) > len(LETTERS):
        raise fail(c_col, f"{len(choices)} options: continuation letter has only "
                   f"{len(LETTERS)} letters")
    listing = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)) \
        if "{choices}" in cfg.template else ""
    values = {"question": question, "choices": listing}
    context = re.sub(r"\{(question|choices)\}", lambda m: values[m.group(1)], cfg.template)
    scored = list(LETTERS[:len(choices)]) if cfg.continuation == "letter" else choices
    return ChoiceRow(question, choices, gold, context, scored, cfg.delimiter)


def _gold(answer: Any, choices: list[str], labels: list[str] | None, field: str,
          fail: Any) -> int:
    if isinstance(answer, bool) or not isinstance(answer, (int, str)):
        raise fail(field, f"the gold option must be an index or a label, got {answer!r}")
    if labels is not None and str(answer) in labels:
        return labels.index(str(answer))
    if isinstance(answer, int) or answer.strip().isdigit():
        index = int(answer)
    elif len(answer.strip()) == 1 and answer.strip().upper() in LETTERS:
        index = LETTERS.index(answer.strip().upper())
    else:
        raise fail(field, f"{answer!r} is not an option's index, label or letter"
                   + (f" (labels: {labels})" if labels else ""))
    if not 0 <= index < len(choices):
        raise fail(field, f"{answer!r} is option {index}, but the row has {len(choices)} "
                   "options (indices are 0-based)", reason="out_of_range")
    return index


def encode_choices(row: ChoiceRow, cfg: ChoiceConfig, tokenizer: Any, max_tokens: int, *,
                   file: str | None = None, line: int | None = None
                   ) -> list[tuple[list[int], list[int]]]:
    """(input ids, loss mask) per option: the context's tokens (mask 0), then the option's
    continuation (mask 1), tokenized as the module docstring says."""
    if cfg.prompt == "chat":
        context_ids = tokenizer.encode_prompt([{"role": "user", "content": row.context}],
                                              source=file, line=line)
    else:                                       # lm-eval's _encode_pair
        context = row.context.rstrip()
        if not context:
            raise DataError("the rendered context is empty", file=file, line=line,
                            field="template", reason="empty")
        spaces = row.context[len(context):]
        context_ids = tokenizer.encode_text(context)
    docs = []
    for option in row.continuations:
        if cfg.prompt == "chat":
            option_ids = tokenizer.encode_text(option)
        else:
            option_ids = tokenizer.encode_text(context + spaces + option)[len(context_ids):]
        if not option_ids:
            raise DataError(f"option {option!r} has no tokens after the context", file=file,
                            line=line, field="choices", reason="empty")
        if len(context_ids) + len(option_ids) > max_tokens:
            raise DataError(f"context and option are {len(context_ids) + len(option_ids)} "
                            f"tokens, more than max_tokens_per_sample {max_tokens}", file=file,
                            line=line, field="choices", reason="too_long")
        docs.append((context_ids + option_ids, [0] * len(context_ids) + [1] * len(option_ids)))
    return docs


def choice_reader(task: Any, tokenizer: Any
                  ) -> Callable[[Any, str | None, int | None], tuple[ChoiceRow, dict]]:
    """How a multiple_choice task reads one raw row (data, file, line): (the row, {"documents":
    its options' (ids, mask)}), or a DataError naming file, line and field."""
    cfg = task.multiple_choice or ChoiceConfig()

    def read(data: Any, file: str | None, line: int | None) -> tuple[ChoiceRow, dict]:
        row = parse_choice_row(data, cfg, file=file, line=line)
        return row, {"documents": encode_choices(row, cfg, tokenizer,
                                                 task.max_tokens_per_sample, file=file,
                                                 line=line)}
    return read


def choice_scores(model: Any, rows: list[tuple[ChoiceRow, dict]], max_tokens: int, pad: int
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(accuracy and accuracy_norm, per row: each option's log-prob sum, the chosen options
    and whether they are right), every option of every row in one packed pass."""
    docs = [d for _, cols in rows for d in cols["documents"]]
    logps = sequence_logps(model, docs, max_tokens_per_forward=max_tokens, pad_token_id=pad)
    scores, start = [], 0
    for row, cols in rows:
        lls = [lp for lp, _ in logps[start:start + len(cols["documents"])]]
        start += len(lls)
        choice = _argmax(lls)
        choice_norm = _argmax([ll / len(s) for ll, s in zip(lls, row.scored)])
        scores.append({"logps": lls, "choice": choice, "choice_norm": choice_norm,
                       "correct": float(choice == row.gold),
                       "correct_norm": float(choice_norm == row.gold)})
    n = len(scores)
    return ({"accuracy": sum(s["correct"] for s in scores) / n,
             "accuracy_norm": sum(s["correct_norm"] for s in scores) / n}, scores)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
