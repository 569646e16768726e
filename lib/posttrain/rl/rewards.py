"""GRPO reward functions: a registry, the built-ins, and their weighted combination.

A reward function is batched::

    @register("name")
    def fn(completions: list[str], prompts: list[list[dict]], columns: dict[str, list[Any]],
           **params) -> list[float]

``columns`` holds the prompt rows' other dataset columns (``columns["answer"][i]`` belongs to
``completions[i]``). The recipe lists the functions in its config::

    rewards:
      functions:
        - {name: exact_match_number, weight: 1.0}
        - {name: format, weight: 0.1}
        - {name: length_penalty, weight: 1.0, params: {target_length: 400}}

and `combine(cfg.functions)` returns a `CombinedReward`: per sample, ``total = sum_k weight_k *
r_k``, plus each function's unweighted values for metrics. A function that raises (or returns
the wrong number of values, or a non-finite one) never stops the run: the batch is retried one
sample at a time so that only the failing samples get 0, and the failures are counted per
function with the first error message (`RewardOutput.failures`, ``reward/<name>/failures``).
A batched function that knows which samples it could not score (a judge's unparseable answer)
returns a `SampleFailure` in their places instead: 0 and counted, without the retry.

Model-based rewards (`posttrain.rl.model_rewards`): ``reward_model`` scores with the reward
recipe's export, ``llm_judge`` asks a model through a rollout engine with a rubric. They hold a
model, in this process or on a Ray actor of their own (``params.placement``), loaded by
`CombinedReward.open` when the run starts (a function registered with ``open=``: a missing
model fails the run there, rather than scoring 0 at every step) and released by
`CombinedReward.close` (``close=``).

A function of your own needs no registration: name it by ``package.module:attribute``
(``{name: "my_rewards:brevity", weight: 0.5, params: {...}}``); it is imported when the config is
built, so a failing import is a ConfigError at launch.

A function declares the dataset columns it reads, so that a prompt row without them is refused
when the data is prepared (`RewardConfig.required_columns` -> ``data.required_columns``) rather
than scoring 0 on every rollout: ``register(name, columns=...)``, or for your own function a
``required_columns`` attribute. Either is a list of column names or a function of the reward's
params that returns one (`column_param`: the column its ``column`` param names).

Unknown names and unknown or missing params are ConfigErrors at config time; built-ins that can
check their param values (a regex compiles) do so then too; what exists only where the run
runs (a model directory) is checked by `CombinedReward.open`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Callable, Literal, Sequence

from posttrain.config.loader import import_attribute
from posttrain.errors import ConfigError
from posttrain.rl.sandbox import IsolationMode, SandboxLimits, require_isolation, run_python

log = logging.getLogger(__name__)

RewardFn = Callable[..., list[float]]
Columns = Sequence[str] | Callable[..., Sequence[str]]


@dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    validate: Callable[..., None] | None
    columns: Columns = ()
    open: Callable[..., None] | None = None
    close: Callable[..., None] | None = None


_REGISTRY: dict[str, _Entry] = {}
# built-ins registered by a module of their own, imported when first named
_BUILTIN_MODULES = {"reward_model": "posttrain.rl.model_rewards",
                    "llm_judge": "posttrain.rl.model_rewards"}


def register(name: str, *, validate: Callable[..., None] | None = None,
             columns: Columns = (), open: Callable[..., None] | None = None,
             close: Callable[..., None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register a batched reward function under `name`.

    `validate(**params)`, if given, checks the param values at config time and raises
    ValueError with a message naming the param. `columns` are the dataset columns it reads, or
    ``columns(**params)`` returns them (params with the function's defaults filled in).
    `open(**params)`, if given, loads what the function needs for these params (a model, a Ray
    actor) and raises if it cannot; `CombinedReward.open` calls it when a run starts.
    `close(**params)` releases it; `CombinedReward.close` calls it at the end of the run.
    """
    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"a reward function named {name!r} is already registered "
                             f"({_REGISTRY[name].fn.__module__}.{_REGISTRY[name].fn.__qualname__})")
        _REGISTRY[name] = _Entry(fn, validate, columns, open, close)
        return fn
    return decorator


def registered_names() -> list[str]:
    return sorted({*_REGISTRY, *_BUILTIN_MODULES})


def get_reward(name: str) -> RewardFn:
    """The registered function `name`, or the one ``module:attribute`` names (imported and
    registered under that name on first use); ConfigError listing the registered ones
    otherwise."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY and ":" in name:
        fn = import_attribute(name, "rewards.functions")
        if not callable(fn) or not _takes_batch(fn):
            raise ConfigError(f"rewards.functions: {name!r} is not a reward function "
                              "fn(completions, prompts, columns, **params) -> list[float]")
        _REGISTRY[name] = _Entry(fn, None, getattr(fn, "required_columns", ()))
    if name not in _REGISTRY:
        raise ConfigError(f"unknown reward function {name!r}; registered: "
                          f"{', '.join(registered_names())} (or name your own as "
                          "'package.module:function')")
    return _REGISTRY[name].fn


def column_param(*, column: str, **params: Any) -> tuple[str]:
    """`columns` of a reward that reads the one column its ``column`` param names."""
    del params
    return (column,)


def _takes_batch(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind([], [], {})
    except (TypeError, ValueError):
        return False
    return True


# --- config -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSpec:
    """One reward function of the sum: `name` in the registry, its `weight`, its `params`."""

    name: str
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fn = get_reward(self.name)
        if not math.isfinite(self.weight):
            raise ConfigError(f"reward {self.name!r}: weight must be finite, got {self.weight}")
        _check_params(self.name, fn, self.params)
        validate = _REGISTRY[self.name].validate
        if validate is not None:
            try:
                validate(**self.params)
            except ValueError as e:
                raise ConfigError(f"reward {self.name!r}: {e}") from None
        self.required_columns  # a malformed declaration fails now, naming the reward

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The dataset columns this function reads with these params."""
        entry = _REGISTRY[self.name]
        columns = entry.columns
        if callable(columns):
            try:
                columns = columns(**{**_param_defaults(entry.fn), **self.params})
            except Exception as e:  # noqa: BLE001 - user code; reported at config time
                raise ConfigError(f"reward {self.name!r}: its required_columns failed: "
                                  f"{_describe(e)}") from None
        if isinstance(columns, str) or not all(isinstance(c, str) and c for c in columns):
            raise ConfigError(f"reward {self.name!r}: its required_columns must be a list of "
                              f"column names, got {columns!r}")
        return tuple(columns)


@dataclass(frozen=True)
class RewardConfig:
    """The rewards' slice of a GRPO config."""

    functions: tuple[RewardSpec, ...]

    def __post_init__(self) -> None:
        if not self.functions:
            raise ConfigError("rewards.functions: list at least one reward function")
        names = [s.name for s in self.functions]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ConfigError(f"rewards.functions: {dups} listed more than once; combine their "
                              "checks in one registered function instead")

    @property
    def required_columns(self) -> tuple[str, ...]:
        """Every dataset column the functions read, sorted."""
        return required_columns(self.functions)


def required_columns(specs: Sequence[RewardSpec]) -> tuple[str, ...]:
    """Every dataset column the functions of `specs` read, sorted."""
    return tuple(sorted({c for spec in specs for c in spec.required_columns}))


def actor_placed(specs: Sequence[RewardSpec]) -> list[str]:
    """The functions of `specs` that run on a Ray actor of their own (``placement: actor``)."""
    return [s.name for s in specs if s.params.get("placement") == "actor"]


def in_process(specs: Sequence[RewardSpec]) -> tuple[RewardSpec, ...]:
    """`specs` with every ``placement: actor`` made ``local`` (and its actor resources
    dropped): for scoring outside a Ray run, e.g. the evaluate step."""
    moved = actor_placed(specs)
    if moved:
        log.info("rewards %s: scored in this process (placement: local), not on an actor",
                 moved)
    return tuple(replace(s, params={k: v for k, v in s.params.items()
                                    if k not in ("num_cpus", "num_gpus")} | {"placement": "local"})
                 if s.name in moved else s for s in specs)


def _param_defaults(fn: RewardFn) -> dict[str, Any]:
    return {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[3:]
            if p.default is not p.empty}


def _check_params(name: str, fn: RewardFn, params: dict[str, Any]) -> None:
    sig = inspect.signature(fn)
    own = [p for p in list(sig.parameters.values())[3:]
           if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in own}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = sorted(set(params) - known)
    if unknown and not takes_any:
        raise ConfigError(f"reward {name!r}: unknown params {unknown}; it takes "
                          f"{sorted(known) or 'none'}")
    missing = sorted(p.name for p in own if p.default is p.empty and p.name not in params)
    if missing:
        raise ConfigError(f"reward {name!r}: required params {missing} are missing")


# --- combination ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleFailure:
    """What a batched reward returns for a sample it could not score: the sample gets 0 and
    counts as a failure of the function, the others keep their values."""

    reason: str


@dataclass(frozen=True)
class RewardFailures:
    count: int = 0  # samples that got 0 because the function failed on them
    first_error: str | None = None


@dataclass(frozen=True)
class RewardOutput:
    total: list[float]  # per sample, sum of weight * component
    components: dict[str, list[float]]  # per function, unweighted, per sample
    failures: dict[str, RewardFailures]  # per function (count 0 when none failed)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Mean/std of the total and of each component, and each function's failure count."""
        out = {f"{prefix}/total/mean": _mean(self.total), f"{prefix}/total/std": _std(self.total)}
        for name, values in self.components.items():
            out[f"{prefix}/{name}/mean"] = _mean(values)
            out[f"{prefix}/{name}/std"] = _std(values)
            out[f"{prefix}/{name}/failures"] = float(self.failures[name].count)
        return out


class CombinedReward:
    """``reward(completions, prompts, columns) -> RewardOutput`` over a list of `RewardSpec`."""

    def __init__(self, specs: Sequence[RewardSpec]):
        if not specs:
            raise ConfigError("combine: no reward function given")
        self.specs = tuple(specs)
        self._warned: set[str] = set()

    def __call__(self, completions: list[str], prompts: list[list[dict]],
                 columns: dict[str, list[Any]] | None = None) -> RewardOutput:
        n = len(completions)
        columns = columns or {}
        if len(prompts) != n:
            raise ValueError(f"{n} completions but {len(prompts)} prompts")
        for key, col in columns.items():
            if len(col) != n:
                raise ValueError(f"column {key!r} has {len(col)} values for {n} completions")
        total = [0.0] * n
        components, failures = {}, {}
        for spec in self.specs:
            values, fail = _call_safely(get_reward(spec.name), spec.params, completions, prompts,
                                        columns)
            if fail.count and spec.name not in self._warned:
                self._warned.add(spec.name)
                log.warning("reward %r failed on %d of %d samples (scored 0): %s", spec.name,
                            fail.count, n, fail.first_error)
            components[spec.name], failures[spec.name] = values, fail
            total = [t + spec.weight * v for t, v in zip(total, values)]
        return RewardOutput(total=total, components=components, failures=failures)

    def open(self) -> None:
        """Load what the functions need (`register`'s ``open``: models, Ray actors) now, so that
        a missing one fails the run at its start; an error here is raised, not counted."""
        for spec in self.specs:
            hook = _REGISTRY[spec.name].open
            if hook is not None:
                hook(**spec.params)

    def close(self) -> None:
        """Release what the functions opened (`register`'s ``close``: models, Ray actors)."""
        for spec in self.specs:
            close = _REGISTRY[spec.name].close
            if close is not None:
                try:
                    close(**spec.params)
                except Exception as e:  # noqa: BLE001 - the run is over; say so, go on
                    log.warning("closing reward %r failed: %s", spec.name, _describe(e))


def combine(specs: Sequence[RewardSpec]) -> CombinedReward:
    return CombinedReward(specs)


def _call_safely(fn: RewardFn, params: dict[str, Any], completions: list[str],
                 prompts: list[list[dict]], columns: dict[str, list[Any]]
                 ) -> tuple[list[float], RewardFailures]:
    n = len(completions)
    try:
        return _settled(_checked(fn(completions, prompts, columns, **params), n))
    except Exception as e:  # noqa: BLE001 - a reward bug must not end the run; it is reported
        if n == 1:
            return [0.0], RewardFailures(1, _describe(e))
    # Isolate the failing samples so that one malformed completion does not zero the batch.
    values: list[float | SampleFailure] = []
    for i in range(n):
        try:
            row = {k: [col[i]] for k, col in columns.items()}
            values.append(_checked(fn([completions[i]], [prompts[i]], row, **params), 1)[0])
        except Exception as e:  # noqa: BLE001
            values.append(SampleFailure(_describe(e)))
    return _settled(values)


def _checked(values: Any, n: int) -> list[float | SampleFailure]:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out = [v if isinstance(v, SampleFailure) else float(v) for v in values]
    bad = [v for v in out if not isinstance(v, SampleFailure) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"returned non-finite values {bad[:3]}")
    return out


def _settled(values: list[float | SampleFailure]) -> tuple[list[float], RewardFailures]:
    """0 in place of each `SampleFailure`, and their count with the first one's reason."""
    failed = [v.reason for v in values if isinstance(v, SampleFailure)]
    return ([0.0 if isinstance(v, SampleFailure) else v for v in values],
            RewardFailures(len(failed), failed[0] if failed else None))


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _column(columns: dict[str, list[Any]], name: str) -> list[Any]:
    if name not in columns:
        raise KeyError(f"the dataset has no column {name!r} (columns: {sorted(columns)}); set "
                       "the reward's `column` param")
    return columns[name]


# --- built-ins --------------------------------------------------------------------------------

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


@register("exact_match_number", columns=column_param)
def exact_match_number(completions: list[str], prompts: list[list[dict]],
                       columns: dict[str, list[Any]], *, column: str = "answer") -> list[float]:
    """1.0 where the completion's final number equals `column`'s number, else 0.0."""
    del prompts
    out = []
    for completion, answer in zip(completions, _column(columns, column)):
        expected = parse_number(str(answer))
        if expected is None:
            raise ValueError(f"column {column!r} value {answer!r} is not a number")
        got = parse_number(completion)
        out.append(1.0 if got is not None and got == expected else 0.0)
    return out


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
    out = []
    for completion, answer in zip(completions, _column(columns, column)):
        expected = parse_number(str(answer))
        if expected is None:
            raise ValueError(f"column {column!r} value {answer!r} is not a number")
        got = parse_number(completion)
        out.append(0.0 if got is None else scale / (scale + float(abs(got - expected))))
    return out


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
