"""GRPO reward functions: the config that names them, and their weighted combination.

A reward function is batched, ``fn(completions, prompts, columns, **params) -> list[float]``,
and registered by name (`posttrain.rl.reward_registry`; the bundled ones are
`posttrain.rl.builtin_rewards`). The recipe lists the functions in its config::

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

import inspect
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from posttrain.errors import ConfigError
# importing the bundled functions registers them
from posttrain.rl.builtin_rewards import parse_number
from posttrain.rl.reward_registry import RewardFn, entry, get_reward, register, registered_names

__all__ = ["CombinedReward", "RewardConfig", "RewardFailures", "RewardOutput", "RewardSpec",
           "SampleFailure", "actor_placed", "combine", "get_reward", "in_process", "parse_number",
           "register", "registered_names", "required_columns"]

log = logging.getLogger(__name__)


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
        validate = entry(self.name).validate
        if validate is not None:
            try:
                validate(**self.params)
            except ValueError as e:
                raise ConfigError(f"reward {self.name!r}: {e}") from None
        self.required_columns  # a malformed declaration fails now, naming the reward

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The dataset columns this function reads with these params."""
        registered = entry(self.name)
        columns = registered.columns
        if callable(columns):
            try:
                columns = columns(**{**_param_defaults(registered.fn), **self.params})
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
            hook = entry(spec.name).open
            if hook is not None:
                hook(**spec.params)

    def close(self) -> None:
        """Release what the functions opened (`register`'s ``close``: models, Ray actors)."""
        for spec in self.specs:
            close = entry(spec.name).close
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
