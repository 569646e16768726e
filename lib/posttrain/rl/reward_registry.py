"""The registry of GRPO reward functions: `register` a batched function under a name,
`get_reward` one by name.

A reward function is batched::

    @register("name")
    def fn(completions: list[str], prompts: list[list[dict]], columns: dict[str, list[Any]],
           **params) -> list[float]

``columns`` holds the prompt rows' other dataset columns (``columns["answer"][i]`` belongs to
``completions[i]``). The bundled functions are `posttrain.rl.builtin_rewards` (registered when
`posttrain.rl.rewards` is imported) and the model-based ones of `posttrain.rl.model_rewards`
(imported when first named); `posttrain.rl.rewards` checks a config's functions and combines
them.

A function of your own needs no registration: name it by ``package.module:attribute``; it is
imported (and registered under that name) when first named. A function declares the dataset
columns it reads (``register(name, columns=...)``, or for your own function a
``required_columns`` attribute): a list of column names or a function of the reward's params
that returns one (`column_param`: the column its ``column`` param names).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from posttrain.config.loader import import_attribute
from posttrain.errors import ConfigError

__all__ = ["Columns", "RewardFn", "column_param", "entry", "get_reward", "register",
           "registered_names"]

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
# bundled functions, registered by a module of their own, imported when first named
_BUILTIN_MODULES = {**dict.fromkeys(("exact_match_number", "numeric_closeness", "format",
                                     "length_penalty", "python_exec"),
                                    "posttrain.rl.builtin_rewards"),
                    "reward_model": "posttrain.rl.model_rewards",
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


def entry(name: str) -> _Entry:
    """What `register` recorded for `name` (a function `get_reward` has already found)."""
    return _REGISTRY[name]


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
