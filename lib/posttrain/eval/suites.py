"""Evaluation suites: tasks from YAML, a model and its baseline, one comparison table.

A suite (`SuiteConfig`, e.g. ``configs/eval/tiny.yaml``) lists tasks; each has a `name`, a
`kind` and a data source, and every task is run on both checkpoints with the same rows, code
and seeds (so a model compared with itself has every delta exactly 0):

* ``heldout_loss``: chat (or sequence) rows -> token-mean cross-entropy on the trained tokens
  (the assistant turns, as SFT trains them) and perplexity ``exp(loss)``; per row, its loss.
* ``generation``: prompt rows with a reference column -> each model answers (greedy, or
  `samples_per_prompt` sampled answers) and a grader scores each answer 0/1:
  ``exact_match`` (the stripped answer equals the stripped reference), ``exact_match_number``
  (its final number equals the reference's, `posttrain.rl.rewards.parse_number`), ``regex``
  (the last match of `pattern` in the answer, its capture group if it has one, equals the
  reference; ``full_match`` matches the whole stripped answer instead), ``gsm8k`` (the
  ``#### N`` answer, else the last number, read as lm-eval-harness's gsm8k filters read them,
  equals the reference's number; the reference may be a whole GSM8K solution;
  `posttrain.eval.benchmarks`). accuracy = mean score; with `pass_at_k` (k <=
  samples_per_prompt), the unbiased pass@k of each k as well.
* ``multiple_choice``: rows with a question, options and the gold option (MMLU, ARC and
  HellaSwag shapes) -> each option scored by the sum of its tokens' log-probs given the
  question (plain text or the chat template): ``accuracy`` and ``accuracy_norm`` (per
  character of the option, lm-eval's acc_norm); `posttrain.eval.benchmarks`.
* ``preference``: pairs (prompt, chosen, rejected) seen as DPO does, with the baseline as the
  reference model: r(y) = beta (log pi(y|x) - log pi_baseline(y|x)). ``reward_accuracy`` is
  the fraction of pairs with r(chosen) > r(rejected) and ``reward_margin`` the mean of
  r(chosen) - r(rejected); the baseline, scored against itself, ties on every pair (0 and 0).
  ``logp_accuracy`` needs no reference: the fraction with log pi(chosen) > log pi(rejected).
* ``reward``: prompt rows -> answers scored by reward functions of the RL registry
  (`posttrain.rl.rewards`), with the metrics of the GRPO evaluation (`posttrain.eval.rl`);
  with an `environment` (`posttrain.rl.environment`) each answer is a multi-turn episode
  (tool calls and their results, feedback) and its final answer is scored.
* ``distill``: chat (or sequence) rows -> token-mean forward KL(teacher || model) on the trained
  tokens (the chunked divergence of `posttrain.losses.distill` at temperature 1), and the
  model's loss; `teacher` is the teacher's checkpoint.
* ``reward_model``: pairs scored by an exported reward model (`posttrain.models.reward_model.
  load_reward_model`): ``accuracy`` (chosen scored higher) and ``mean_margin``.

The baseline is optional (a reward model has none to compare with; a first retraining run has
no promoted model): without one, a task reports the model's metrics only. Each recipe builds
its held-out evaluation as a suite from its own config (`Recipe.eval_suite`), and one step,
`steps/evaluate.py`, runs any suite.

Rows are read straight from the source (its first `max_samples`), validated and tokenized as
`prepare` does: `RowParser` (any shape of the task's format, `posttrain.data.shapes`, decided by
the first row or forced by the source's ``shape:``) and `RecordEncoder` with the suite's
tokenizer and its chat template
(the checkpoint's own tokenizer when the suite names none). Log-probs (loss, preference) come
from the native model over packed rows with document boundaries and the chunked log-prob op, as
in training; answers come from a rollout engine (`posttrain.rl.factory.load_engine`: the native
KV-cache generator, or vLLM with ``rollout.kind: vllm``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from posttrain.config.loader import to_dict
from posttrain.config.recipes import ColumnNames, load_recipe
from posttrain.data.encode import LengthConfig, RecordEncoder
from posttrain.data.formats import (ChatRecord, FormatConfig, FormatName, PreferenceRecord,
                                    PromptRecord, Record, RowParser, SequenceRecord)
from posttrain.data.shapes import DEFAULT_ROLE_MAP, UnknownShape, check_shape
from posttrain.data.sources import RowStream, SourceConfig
from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
from posttrain.errors import ConfigError, DataError
from posttrain.eval.benchmarks import (ChoiceConfig, ChoiceRow, check_pass_at_k, choice_reader,
                                       choice_scores, gsm8k_number, pass_at_k_metrics)
from posttrain.eval.heldout import sequence_logps
from posttrain.eval.preference import preference_metrics
from posttrain.models.args import DTYPES
from posttrain.models.transformer import Transformer
from posttrain.rl.engine import SamplingConfig, stop_token_ids
from posttrain.rl.environment import EnvironmentConfig
from posttrain.rl.factory import RolloutEngineConfig, load_engine
from posttrain.rl.rewards import (RewardFailures, RewardOutput, RewardSpec, combine, in_process,
                                  parse_number, required_columns)

__all__ = ["GenerationSettings", "GraderConfig", "SuiteConfig", "SuiteResult", "TaskConfig",
           "TaskResult", "load_suite", "run_suite"]

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


# --------------------------------------------------------------------------- config


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
        """1.0 when `answer` is right, else 0.0 (module docstring)."""
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


def load_suite(path: str, overrides: dict | None = None) -> SuiteConfig:
    """Read a suite YAML strictly: an unknown key fails, naming the file and the key."""
    return load_recipe(path, SuiteConfig, overrides)


# --------------------------------------------------------------------------- results


@dataclass
class TaskResult:
    """One task's metrics for both checkpoints, their differences, and per-sample records."""

    name: str
    kind: str
    model: dict[str, float]
    baseline: dict[str, float]          # {} without a baseline
    delta: dict[str, float]             # model - baseline ({} without a baseline)
    num_samples: int
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped_rows: int = 0               # bad rows skipped (task on_bad_row: skip)


@dataclass
class SuiteResult:
    model_dir: str
    baseline_dir: str | None
    suite: dict[str, Any]
    tasks: list[TaskResult]

    def table(self) -> list[dict[str, Any]]:
        """Rows (task, metric, model, baseline, delta), tasks in suite order; baseline and
        delta are None without a baseline."""
        return [{"task": t.name, "metric": k, "model": t.model[k],
                 "baseline": t.baseline.get(k), "delta": t.delta.get(k)}
                for t in self.tasks for k in t.model]

    def metrics(self, task: str | None = None) -> dict[str, float]:
        """The model's metrics of `task` (default: the first task)."""
        found = [t for t in self.tasks if task is None or t.name == task]
        if not found:
            raise KeyError(f"no task {task!r} in the suite")
        return dict(found[0].model)

    def to_dict(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "baseline_dir": self.baseline_dir,
                "suite": self.suite, "table": self.table(),
                "tasks": {t.name: {"kind": t.kind, "num_samples": t.num_samples,
                                   "skipped_rows": t.skipped_rows, "model": t.model,
                                   "baseline": t.baseline, "delta": t.delta,
                                   "records": t.records} for t in self.tasks}}


# --------------------------------------------------------------------------- running


@dataclass
class _Pass:
    """What one checkpoint did on one task: metrics (None: computed with the other model's
    pass) and, per row, its answer (or None) and scores."""

    metrics: dict[str, float] | None
    outputs: list[str | None]
    scores: list[dict[str, float]]


def run_suite(cfg: SuiteConfig, model_dir: str, baseline_dir: str | None = None) -> SuiteResult:
    """Evaluate the checkpoint (and the baseline, when given) on every task of `cfg` and
    compare them (module docstring)."""
    tokenizer = ChatTokenizer(cfg.tokenizer or TokenizerConfig(path=model_dir))
    for task in cfg.tasks:                  # fail on a bad stop token before loading models
        if task.generation is not None:
            stop_token_ids(tokenizer.hf, task.generation.stop_tokens,
                           key="generation.stop_tokens")
        if task.kind == "preference" and baseline_dir is None:
            raise ConfigError(f"task {task.name!r}: a preference task needs a baseline (the "
                              "reference of the implicit rewards)")
    read = {t.name: _read_rows(t, tokenizer) for t in cfg.tasks}
    rows = {name: r for name, (r, _) in read.items()}
    teachers: dict[str, Transformer] = {}
    model = _evaluate_checkpoint(cfg, model_dir, tokenizer, rows, teachers)
    baseline = (_evaluate_checkpoint(cfg, baseline_dir, tokenizer, rows, teachers)
                if baseline_dir else {})
    tasks = [_compare(t, rows[t.name], model[t.name], baseline.get(t.name), read[t.name][1])
             for t in cfg.tasks]
    return SuiteResult(model_dir, baseline_dir, to_dict(cfg), tasks)


def _read_rows(task: TaskConfig, tokenizer: ChatTokenizer
               ) -> tuple[list[tuple[Record, dict]], int]:
    """(record, token columns) of the task's first rows, and how many bad rows were skipped;
    a bad row fails naming file and line unless the task skips them."""
    read = choice_reader(task, tokenizer) if task.kind == "multiple_choice" else \
        _record_reader(task, tokenizer)
    out: list[tuple[Record, dict]] = []
    skipped = 0
    with RowStream.from_source(task.data) as stream:
        for raw in stream:
            if task.max_samples is not None and len(out) >= task.max_samples:
                break
            try:
                if raw.error is not None:
                    raise raw.error
                out.append(read(raw.data, raw.file, raw.line))
            except DataError as err:
                if task.on_bad_row == "error" or isinstance(err, UnknownShape):
                    raise
                skipped += 1
    if not out:
        raise DataError(f"task {task.name!r}: the source has no rows", file=str(task.data.path))
    return out, skipped


def _record_reader(task: TaskConfig, tokenizer: ChatTokenizer) -> Any:
    """How a task reads one raw row (data, file, line) as `prepare` does: (record, token
    columns)."""
    c = task.columns
    fmt = FormatConfig(format=task.data_format, messages_field=c.messages,
                       prompt_field=c.prompt, chosen_field=c.chosen, rejected_field=c.rejected,
                       completion_field=c.completion, label_field=c.label, text_field=c.text,
                       role_map=tuple({**DEFAULT_ROLE_MAP, **task.role_map}.items()),
                       required_columns=required_columns(task.rewards)
                       ).with_template(tokenizer.hf)
    parser = RowParser(fmt, task.data.shape)
    encoder = RecordEncoder(tokenizer, task.data_format,
                            LengthConfig(task.max_tokens_per_sample, "truncate"))
    reference = task.reference_column or "answer"

    def read(data: Any, file: str, line: int) -> tuple[Record, dict]:
        record = parser.parse(data, file=file, line=line)
        if task.kind == "generation":
            _check_reference(task, record, reference, file, line)
        return record, encoder.encode(record, file=file, line=line).columns
    return read


def _check_reference(task: TaskConfig, record: Record, column: str, file: str,
                     line: int) -> None:
    assert isinstance(record, PromptRecord)
    if column not in record.extras:
        raise DataError(f"task {task.name!r}: the row has no reference column {column!r} (set "
                        "the task's reference_column)", file=file, line=line, field=column,
                        reason="missing_field")
    number = {"exact_match_number": parse_number, "gsm8k": gsm8k_number}.get(task.grader.kind)
    if number is not None and number(str(record.extras[column])) is None:
        raise DataError(f"task {task.name!r}: reference {record.extras[column]!r} is not a "
                        f"number (grader {task.grader.kind})", file=file, line=line,
                        field=column, reason="wrong_type")


def _evaluate_checkpoint(cfg: SuiteConfig, hf_dir: str, tokenizer: ChatTokenizer,
                         rows: dict[str, list[tuple[Record, dict]]],
                         teachers: dict[str, Transformer]) -> dict[str, _Pass]:
    """Every task on one checkpoint: log-prob tasks with the native model, then the answers.
    `teachers` caches the distill tasks' teachers across checkpoints."""
    from posttrain.models.auto import load_model
    scoring = [t for t in cfg.tasks
               if t.kind in ("heldout_loss", "preference", "distill", "multiple_choice")]
    answering = [t for t in cfg.tasks if t.kind in ("generation", "reward")]
    out: dict[str, _Pass] = {t.name: _reward_model_pass(hf_dir, rows[t.name])
                             for t in cfg.tasks if t.kind == "reward_model"}
    model = None
    if scoring or (answering and cfg.rollout.kind == "native"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_model(hf_dir, device=device, dtype=DTYPES[cfg.dtype]).eval()
        if model.head.real_vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"checkpoint {hf_dir} has {model.head.real_vocab_size} token ids "
                              f"but the suite's tokenizer has {tokenizer.vocab_size}; evaluate "
                              "with the tokenizer it was trained with")
    pad = tokenizer.pad_token_id or 0
    for task in scoring:
        if task.kind == "multiple_choice":
            metrics, scores = choice_scores(model, rows[task.name], cfg.max_tokens_per_forward,
                                            pad)
            out[task.name] = _Pass(metrics, [None] * len(scores), scores)
            continue
        if task.kind == "distill":
            if task.teacher not in teachers:
                teachers[task.teacher] = load_model(task.teacher,
                                                    device=model.embed.weight.device,
                                                    dtype=DTYPES[cfg.dtype]).eval()
            out[task.name] = _distill_pass(model, teachers[task.teacher], rows[task.name],
                                           cfg.max_tokens_per_forward, pad)
            continue
        if task.kind == "preference":
            out[task.name] = _preference_pass(model, rows[task.name], cfg.max_tokens_per_forward,
                                              pad, task.logp_reduction or "sum")
            continue
        out[task.name] = _loss_pass(model, rows[task.name], cfg.max_tokens_per_forward, pad)
        if task.samples:
            _add_samples(out[task.name], task, model, tokenizer, rows[task.name])
    if answering:
        if cfg.rollout.kind != "native" and model is not None:
            del model                           # vLLM loads its own copy: free the GPU first
            torch.cuda.empty_cache()
            model = None
        engine = load_engine(cfg.rollout, hf_dir, dtype=cfg.dtype, model=model)
        for task in answering:
            out[task.name] = _answer_pass(task, engine, tokenizer, rows[task.name])
        del engine
    return out


def _loss_pass(model: Transformer, rows: list[tuple[Record, dict]], max_tokens: int,
               pad: int) -> _Pass:
    logps = sequence_logps(model, [(c["input_ids"], c["loss_mask"]) for _, c in rows],
                           max_tokens_per_forward=max_tokens, pad_token_id=pad)
    total, tokens = -sum(lp for lp, _ in logps), sum(n for _, n in logps)
    loss = total / max(tokens, 1)
    return _Pass({"loss": loss, "perplexity": math.exp(min(loss, 50.0))}, [None] * len(rows),
                 [{"loss": -lp / max(n, 1), "tokens": n} for lp, n in logps])


def _add_samples(done: _Pass, task: TaskConfig, model: Transformer, tokenizer: ChatTokenizer,
                 rows: list[tuple[Record, dict]]) -> None:
    """Greedy answers to the first `task.samples` chats' last assistant turn, as outputs."""
    from posttrain.eval.heldout import sample_table
    chats = [r.messages for r, _ in rows[:task.samples] if isinstance(r, ChatRecord)]
    settings = task.generation or GenerationSettings(max_new_tokens=48)
    table = sample_table(model, tokenizer, chats, max_new_tokens=settings.max_new_tokens)
    for i, row in enumerate(table):
        done.outputs[i] = row["generated"]


def _distill_pass(model: Transformer, teacher: Transformer, rows: list[tuple[Record, dict]],
                  max_tokens: int, pad: int) -> _Pass:
    """Token means over the rows' trained tokens: forward KL(teacher || model), the model's
    loss; per row, nothing (the metrics are token means over the packed rows)."""
    from posttrain.eval.heldout import packed_rows
    from posttrain.losses.distill import distill_loss
    from posttrain.losses.sft import sft_loss_sum
    if model.head.real_vocab_size != teacher.head.real_vocab_size:
        raise ConfigError(f"the teacher has {teacher.head.real_vocab_size} token ids, the model "
                          f"{model.head.real_vocab_size}: distillation compares distributions "
                          "over one vocabulary")
    kl = loss = 0.0
    tokens = 0
    docs = [(c["input_ids"], c["loss_mask"]) for _, c in rows]
    with torch.no_grad():
        for batch, _ in packed_rows(docs, max_tokens_per_forward=max_tokens, pad_token_id=pad,
                                    device=model.embed.weight.device):
            args = (batch["input_ids"], batch["position_ids"], batch["document_lengths"])
            h_m, h_t = model(*args), teacher(*args)
            div, _ = distill_loss(h_m, model.head.weight, h_t, teacher.head.weight,
                                  batch["labels"], kind="forward_kl",
                                  real_vocab_size=model.head.real_vocab_size, reduction="sum")
            kl += float(div)
            loss += float(sft_loss_sum(h_m, model.head.weight, batch["labels"],
                                       real_vocab_size=model.head.real_vocab_size))
            tokens += int(batch["num_loss_tokens"])
    n = max(tokens, 1)
    return _Pass({"kl_teacher_model": kl / n, "loss": loss / n, "tokens": float(tokens)},
                 [None] * len(rows), [{} for _ in rows])


def _reward_model_pass(hf_dir: str, rows: list[tuple[Record, dict]]) -> _Pass:
    """Each pair's chosen and rejected response scored by the exported reward model in
    `hf_dir`; a checkpoint without a reward head (a baseline) has no metrics."""
    from pathlib import Path

    from posttrain.models.reward_model import HEAD_JSON, load_reward_model
    if not (Path(hf_dir) / HEAD_JSON).is_file():
        return _Pass({}, [None] * len(rows), [{} for _ in rows])
    score = load_reward_model(hf_dir)
    scores = []
    for record, _ in rows:
        assert isinstance(record, PreferenceRecord)
        scores.append({"score_chosen": score(record.prompt, record.chosen[-1]["content"]),
                       "score_rejected": score(record.prompt,
                                               record.rejected[-1]["content"])})
    margins = [s["score_chosen"] - s["score_rejected"] for s in scores]
    return _Pass({"accuracy": sum(m > 0 for m in margins) / len(margins),
                  "mean_margin": sum(margins) / len(margins)}, [None] * len(rows), scores)


def _preference_pass(model: Transformer, rows: list[tuple[Record, dict]], max_tokens: int,
                     pad: int, reduction: str = "sum") -> _Pass:
    docs = [(c[f"{side}_input_ids"], c[f"{side}_loss_mask"])
            for _, c in rows for side in ("chosen", "rejected")]
    logps = sequence_logps(model, docs, max_tokens_per_forward=max_tokens, pad_token_id=pad)
    if reduction == "mean":                 # per response token, as DPO's logp_reduction
        logps = [(lp / max(n, 1), n) for lp, n in logps]
    return _Pass(None, [None] * len(rows),
                 [{"logp_chosen": logps[2 * i][0], "logp_rejected": logps[2 * i + 1][0]}
                  for i in range(len(rows))])


class _Grading:
    """A generation task's grader in the shape of a combined reward (one component)."""

    def __init__(self, task: TaskConfig):
        self.grader, self.column = task.grader, task.reference_column or "answer"

    def __call__(self, completions: list[str], prompts: list[list[dict]],
                 columns: dict[str, list[Any]]) -> RewardOutput:
        scores = [self.grader.score(c, ref) for c, ref in zip(completions, columns[self.column])]
        return RewardOutput(total=scores, components={"correct": scores},
                            failures={"correct": RewardFailures()})


def _answer_pass(task: TaskConfig, engine: Any, tokenizer: ChatTokenizer,
                 rows: list[tuple[Record, dict]]) -> _Pass:
    from posttrain.eval.rl import reward_eval
    from posttrain.rl.episodes import EpisodeRunner
    from posttrain.rl.prompts import PromptRow
    settings = task.generation or GenerationSettings()
    stops = stop_token_ids(tokenizer.hf, settings.stop_tokens, key="generation.stop_tokens")
    sampling = settings.sampling(stops)
    environment = task.environment or EnvironmentConfig()
    episodes = EpisodeRunner(environment, tokenizer, stops, stop_key="generation.stop_tokens")
    prompts = [PromptRow([int(i) for i in c["prompt_ids"]], r.prompt, r.extras) for r, c in rows]
    if task.kind == "generation":
        reward, accuracy, names = _Grading(task), "correct", ["correct"]
    else:
        # in this process: an evaluation has no Ray run for a reward model's actor
        reward, accuracy = combine(in_process(task.rewards)), task.accuracy_reward
        names = ["reward", *(r.name for r in task.rewards)]
        if not environment.single_turn:
            names.append("environment")

    played: list[list[Any]] = []

    def generate(prompt_rows: list[PromptRow]) -> list[list[Any]]:
        played[:] = episodes.run(prompt_rows, settings.samples_per_prompt, engine.generate,
                                 sampling)
        return played

    metrics, records = reward_eval(generate, prompts, reward, accuracy_reward=accuracy,
                                   num_records=len(prompts), prefix="eval",
                                   environment=not environment.single_turn)
    metrics = {k.split("/", 1)[1]: float(v) for k, v in metrics.items()
               if k.split("/", 1)[1] not in ("num_prompts", "samples_per_prompt")}
    if task.kind == "generation":            # accuracy already says it
        metrics = {k: v for k, v in metrics.items()
                   if k not in ("reward_mean", "correct_mean", "correct_failures")}
    scores = [{k: r[k] for k in names} for r in records]
    n, passes = settings.samples_per_prompt, {}
    if task.kind == "generation" and (n > 1 or task.pass_at_k):
        column = task.reference_column or "answer"
        counts = [int(sum(task.grader.score(e.answer, r.extras[column]) for e in group))
                  for group, (r, _) in zip(played, rows)]
        passes = pass_at_k_metrics(counts, n, task.pass_at_k)
        for score, group, c in zip(scores, played, counts):
            score.update(samples=[e.answer for e in group], num_correct=c)
    if "accuracy" in metrics:
        metrics = {"accuracy": metrics.pop("accuracy"), **passes, **metrics}
    return _Pass(metrics, [r["completion"] for r in records], scores)


# --------------------------------------------------------------------------- comparing


def _compare(task: TaskConfig, rows: list[tuple[Record, dict]], model: _Pass,
             baseline: _Pass | None, skipped: int) -> TaskResult:
    extra: list[dict[str, float]] = [{} for _ in rows]
    if task.kind == "preference":
        assert baseline is not None
        beta = task.beta if task.beta is not None else 0.1
        model.metrics, margins = preference_metrics(model.scores, baseline.scores, beta)
        baseline.metrics, _ = preference_metrics(baseline.scores, baseline.scores, beta)
        extra = [{"reward_margin": m} for m in margins]
    assert model.metrics is not None
    base = baseline.metrics if baseline is not None else {}
    assert base is not None
    delta = {k: model.metrics[k] - base[k] for k in model.metrics if k in base}
    records = []
    for i, (record, _) in enumerate(rows):
        rec = _describe(task, record)
        if model.outputs[i] is not None:
            rec["model_output"] = model.outputs[i]
            if baseline is not None:
                rec["baseline_output"] = baseline.outputs[i]
        rec.update({f"model_{k}": v for k, v in model.scores[i].items()})
        if baseline is not None:
            rec.update({f"baseline_{k}": v for k, v in baseline.scores[i].items()})
        rec.update(extra[i])
        records.append(rec)
    return TaskResult(task.name, task.kind, model.metrics, base, delta, len(rows), records,
                      skipped)


def _describe(task: TaskConfig, record: Record) -> dict[str, Any]:
    """The columns of a per-sample record that do not depend on the model."""
    if isinstance(record, ChoiceRow):
        return record.describe()
    if isinstance(record, ChatRecord):
        return {"prompt": _last(record.messages, "user"),
                "reference": _last(record.messages, "assistant")}
    if isinstance(record, SequenceRecord):
        return {"text": record.text[:200] if record.text is not None else
                f"{len(record.tokens or [])} tokens"}
    if isinstance(record, PreferenceRecord):
        return {"prompt": _last(record.prompt, "user"),
                "chosen": _last(record.chosen, "assistant"),
                "rejected": _last(record.rejected, "assistant")}
    assert isinstance(record, PromptRecord)
    out: dict[str, Any] = {"prompt": _last(record.prompt, "user")}
    if task.kind == "generation":
        out["reference"] = record.extras[task.reference_column or "answer"]
    else:
        out.update({k: v for k, v in record.extras.items()
                    if isinstance(v, (str, int, float, bool))})
    return out


def _last(messages: list[dict[str, Any]], role: str) -> str:
    found = [m.get("content", "") for m in messages if m.get("role") == role]
    return str(found[-1]) if found else ""
