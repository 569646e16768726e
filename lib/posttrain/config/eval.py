"""An evaluation suite's config (`SuiteConfig`: tasks, tokenizer, rollout engine) and its
tasks' slices (`TaskConfig`, `GraderConfig`, `GenerationSettings`); what the task kinds mean is
`posttrain.eval.suites`' docstring.

Kept apart from `posttrain.eval.suites` (it runs models: torch) so that a suite, or a recipe
whose ``eval.tasks`` are suite tasks, is read and checked without importing torch; the suites
module imports them from here (the old import paths keep working).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.data import SourceConfig, TokenizerConfig
from posttrain.config.recipes import ColumnNames
from posttrain.config.rl import EnvironmentConfig, RolloutEngineConfig, SamplingConfig
from posttrain.data.formats import FormatName
from posttrain.data.shapes import check_shape
from posttrain.eval.benchmarks import ChoiceConfig, check_pass_at_k, gsm8k_number
from posttrain.rl.rewards import RewardSpec, parse_number


TaskKind = Literal["heldout_loss", "generation", "preference", "reward", "distill",
                   "reward_model", "multiple_choice"]


# Options that only some kinds read: setting one on another kind is a config error.
_KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "format": ("heldout_loss", "distill"),
    "reference_column": ("generation",),
    "grader": ("generation",),
    "generation": ("generation", "reward", "heldout_loss"),
    "rewards": ("reward",),
    "accuracy_reward": ("reward",),
    "environment": ("reward",),
    "beta": ("preference",),
    "logp_reduction": ("preference",),
    "teacher": ("distill",),
    "samples": ("heldout_loss",),
    "pass_at_k": ("generation",),
    "multiple_choice": ("multiple_choice",),
}


@dataclass(frozen=True)
class GraderConfig:
    """How a generation task scores an answer against the row's reference (0 or 1)."""

    kind: Literal["exact_match", "exact_match_number", "regex", "gsm8k"]
    pattern: str | None = None          # regex: at most one capture group
    full_match: bool = False            # regex: match the whole (stripped) answer
    extract: Literal["auto", "strict", "flexible"] | None = None   # gsm8k; default auto

    def __post_init__(self) -> None:
        if self.extract is not None and self.kind != "gsm8k":
            raise ValueError(f"extract applies to kind gsm8k, not {self.kind}")
        if self.kind != "regex":
            if self.pattern is not None or self.full_match:
                raise ValueError(f"pattern and full_match apply to kind regex, not {self.kind}")
            return
        if not self.pattern:
            raise ValueError("pattern: required for kind regex")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ValueError(f"pattern: {self.pattern!r} is not a valid regex: {e}") from None
        if groups > 1:
            raise ValueError(f"pattern: {self.pattern!r} has {groups} capture groups; use at most "
                             "one (the part compared with the reference), (?:...) for the rest")

    def score(self, answer: str, reference: Any) -> float:
        """1.0 when `answer` is right, else 0.0 (`posttrain.eval.suites` describes the kinds)."""
        expected = str(reference).strip()
        if self.kind == "gsm8k":
            want, got = gsm8k_number(expected), gsm8k_number(answer, self.extract or "auto")
            return float(got is not None and got == want)
        if self.kind == "exact_match_number":
            want, got = parse_number(expected), parse_number(answer)
            return float(got is not None and got == want)
        if self.kind == "exact_match":
            return float(answer.strip() == expected)
        regex = re.compile(self.pattern, re.DOTALL)
        if self.full_match:
            found = regex.fullmatch(answer.strip())
        else:
            found = ([None] + list(regex.finditer(answer)))[-1]
        if found is None:
            return 0.0
        got = found.group(1) if regex.groups else found.group(0)
        return float(got is not None and got.strip() == expected)


@dataclass(frozen=True)
class GenerationSettings:
    """How a model answers: greedy (temperature 0) or sampled, `samples_per_prompt` each."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    samples_per_prompt: int = 1
    stop_tokens: tuple[str, ...] = ()   # besides the tokenizer's eos, e.g. "<|im_end|>"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.temperature == 0 and self.samples_per_prompt != 1:
            raise ValueError("samples_per_prompt > 1 needs temperature > 0 (greedy answers to "
                             "one prompt are all the same)")
        SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def sampling(self, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
        greedy = self.temperature == 0
        return SamplingConfig(temperature=self.temperature, top_p=1.0 if greedy else self.top_p,
                              top_k=0 if greedy else self.top_k,
                              max_new_tokens=self.max_new_tokens,
                              stop_token_ids=stop_token_ids, seed=self.seed)


@dataclass(frozen=True)
class TaskConfig:
    """One task of a suite; options that do not apply to its `kind` must stay unset."""

    name: str
    kind: TaskKind
    data: SourceConfig
    max_samples: int | None = None      # the first rows of the source; None: all
    max_tokens_per_sample: int = 4096   # longer rows are truncated (prompts are refused)
    columns: ColumnNames = ColumnNames()
    role_map: dict[str, str] = field(default_factory=dict)   # ShareGPT speakers (data.role_map)
    format: Literal["chat", "sequence"] | None = None   # heldout_loss; default chat
    reference_column: str | None = None                 # generation; default "answer"
    grader: GraderConfig | None = None                   # generation
    generation: GenerationSettings | None = None         # generation, reward
    rewards: tuple[RewardSpec, ...] = ()                 # reward
    accuracy_reward: str | None = None                   # reward: its mean is "accuracy"
    environment: EnvironmentConfig | None = None         # reward: multi-turn episodes
    beta: float | None = None                            # preference; default 0.1
    logp_reduction: Literal["sum", "mean"] | None = None   # preference; default sum (DPO's)
    teacher: str | None = None                           # distill: the teacher checkpoint
    samples: int | None = None    # heldout_loss: greedy answers to the first rows' last turn
    pass_at_k: tuple[int, ...] = ()                      # generation: k <= samples_per_prompt
    multiple_choice: ChoiceConfig | None = None          # multiple_choice; default ChoiceConfig()
    on_bad_row: Literal["error", "skip"] = "error"       # skip: counted in the result

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"name: {self.name!r} must be letters, digits, '_', '.' or '-'")
        for key, kinds in _KIND_OPTIONS.items():
            if self.kind not in kinds and getattr(self, key) not in (None, ()):
                raise ValueError(f"{key}: applies to kind {' or '.join(kinds)}, not {self.kind}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {self.max_samples}")
        if self.kind == "generation" and self.grader is None:
            raise ValueError("grader: required for kind generation (kind: exact_match, "
                             "exact_match_number, regex or gsm8k)")
        check_pass_at_k(self.pass_at_k, self.generation.samples_per_prompt
                        if self.generation else 1)
        if self.kind == "reward":
            if not self.rewards:
                raise ValueError("rewards: list at least one reward function")
            names = [r.name for r in self.rewards]
            if len(set(names)) != len(names):
                raise ValueError(f"rewards: a function is listed twice in {names}")
            if self.accuracy_reward is not None and self.accuracy_reward not in names:
                raise ValueError(f"accuracy_reward: {self.accuracy_reward!r} is not one of the "
                                 f"task's rewards {names}")
        if self.beta is not None and not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.kind == "distill" and not self.teacher:
            raise ValueError("teacher: required for kind distill (the teacher's checkpoint)")
        if self.samples is not None and self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.kind == "multiple_choice" and self.data.shape is not None:
            raise ValueError("data.shape: a multiple_choice task reads its own rows (question, "
                             "options, gold); shapes apply to the other kinds")
        if self.kind != "multiple_choice":
            check_shape(self.data_format, self.data.shape, "data.shape")

    @property
    def data_format(self) -> FormatName:
        if self.kind in ("heldout_loss", "distill"):
            return self.format or "chat"
        return "preference" if self.kind in ("preference", "reward_model") else "prompt"


@dataclass(frozen=True)
class SuiteConfig:
    """A suite: its tasks, the tokenizer, and how models are run."""

    tasks: tuple[TaskConfig, ...]
    tokenizer: TokenizerConfig | None = None    # None: the evaluated checkpoint's tokenizer
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_tokens_per_forward: int = 4096          # packed row length of loss/preference forwards
    rollout: RolloutEngineConfig = RolloutEngineConfig()

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("tasks: list at least one task")
        names = [t.name for t in self.tasks]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"tasks: task names must be unique; {dups} repeat")
        if self.rollout.placement != "colocated":
            raise ValueError("rollout.placement: an evaluation runs its engine in process; "
                             "use colocated")
        if self.max_tokens_per_forward < 2:
            raise ValueError("max_tokens_per_forward must be at least 2")
