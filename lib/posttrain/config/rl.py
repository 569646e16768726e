"""The RL parts' config slices: how completions are sampled (`SamplingConfig`, with the
allowed-id windows `check_token_ranges` checks), which rollout engine makes them
(`RolloutEngineConfig`), the environment an episode runs in (`EnvironmentConfig`) and how
event rows become histories (`EventEpisodesConfig`).

Kept apart from `posttrain.rl` (the engines import torch) so that a config is read and checked
without importing torch; those modules import them from here (the old import paths keep
working). User code a config names (an engine class, an environment) is imported when the
config is built, as before.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from posttrain.config.loader import import_attribute
from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.rl.environment import Environment


TokenRanges = tuple[tuple[int, int], ...]


def check_token_ranges(ranges: object, vocab_size: int | None = None, *,
                       key: str = "allowed_token_ranges") -> TokenRanges:
    """`ranges` as a tuple of ``(lo, hi)`` windows of allowed ids (``lo <= id < hi``), checked:
    integers, ``0 <= lo < hi`` (``<= vocab_size`` when given), ascending and disjoint. An empty
    tuple allows every id. A ValueError names `key`."""
    out = []
    for r in ranges or ():            # type: ignore[union-attr]
        if (not isinstance(r, (tuple, list)) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise ValueError(f"{key}: each range is [lo, hi), two integers; got {r!r}")
        lo, hi = int(r[0]), int(r[1])
        if not 0 <= lo < hi or (vocab_size is not None and hi > vocab_size):
            limit = "" if vocab_size is None else f" <= {vocab_size} (the vocabulary size)"
            raise ValueError(f"{key}: range [{lo}, {hi}) must have 0 <= lo < hi{limit}")
        if out and lo < out[-1][1]:
            raise ValueError(f"{key}: ranges must be ascending and disjoint; [{lo}, {hi}) "
                             f"starts inside or before [{out[-1][0]}, {out[-1][1]})")
        out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample completions.

    temperature: 0 is greedy. top_p: nucleus mass in (0, 1], 1 is off. top_k: 0 is off.
    max_new_tokens: completion tokens per sample, at most. stop_token_ids: a sampled id in this
    set ends its sample (the stop token is kept in `completion_ids`, with its log-prob).
    seed: seeds the engine's sampler; the same prompts, config and weights give the same rollouts.
    allowed_token_ranges: ``(lo, hi)`` windows of the ids that may be sampled, ascending and
    disjoint (`posttrain.rl.engine`); empty: every id of the vocabulary. Stop ids must be among
    them.
    record_routing: an MoE model's engine returns each rollout's expert choices
    (`Rollout.routing`, for routing replay: `posttrain.models.routing_replay`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    allowed_token_ranges: tuple[tuple[int, int], ...] = ()
    record_routing: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0: greedy), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, "
                             f"got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        ranges = check_token_ranges(self.allowed_token_ranges,
                                    key="SamplingConfig.allowed_token_ranges")
        object.__setattr__(self, "allowed_token_ranges", ranges)
        outside = [t for t in self.stop_token_ids
                   if ranges and not any(lo <= t < hi for lo, hi in ranges)]
        if outside:
            raise ValueError(f"SamplingConfig.stop_token_ids {outside} are not among the allowed "
                             f"ids {[list(r) for r in ranges]}: they could never be sampled")

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned log-probs are computed at (1 when greedy)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True)
class RolloutEngineConfig:
    """Which engine generates the rollouts and where it runs.

    kind: ``native`` (our KV-cache generator), ``vllm``, or ``package.module:Class``: an engine
        of your own implementing `posttrain.rl.engine.RolloutEngine`, built as its docstring
        says with `options` as further keyword arguments (imported when the config is built).
    placement: ``colocated``: every trainer rank also hosts an engine on its device and the two
        take turns (no extra devices; weights copied in process, a tensor at a time).
        ``separate``: `num_engines` Ray actors with `resources_per_engine` each (e.g.
        ``{num_gpus: 1}``) generate while the trainers own their devices; weights are gathered
        per bucket and broadcast from trainer rank 0 to the engines over a process group of
        their own (gloo on CPUs, NCCL on GPUs; `posttrain.rl.weight_sync`).
    sync_bucket_mb: separate placement: the size of one broadcast bucket (trainer rank 0 holds
        one bucket and one full tensor at a time, not the model).
    max_batch_sequences: native engine: sequences decoded together, at most.
    max_staleness: asynchronous rollouts (placement ``separate``): the engines generate the
        batches of up to `max_staleness` steps ahead while the trainers update, so a batch is
        trained at most that many policy versions after the one that sampled it (0: the
        synchronous loop; `posttrain.rl.pipeline`).
    vllm: keyword arguments of `posttrain.rl.vllm_engine.VLLMEngine` (gpu_memory_utilization,
        tensor_parallel_size, kv_cache_memory_bytes, enforce_eager, ...).
    options: keyword arguments of your own engine class (``kind: module:Class`` only).
    release_memory: colocated: the engine gives back its memory (KV cache, weights) after
        generating, so the trainers' update runs without it, and takes it back for the next
        (then full) weight sync. vLLM sleeps (CUDA only; elsewhere it warns and keeps it).
    """

    kind: str = "native"                 # native | vllm | package.module:Class
    placement: Literal["colocated", "separate"] = "colocated"
    num_engines: int = 1
    resources_per_engine: dict[str, float] = field(default_factory=dict)
    sync_bucket_mb: float = 256.0
    max_batch_sequences: int = 256
    max_staleness: int = 0
    vllm: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    release_memory: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("native", "vllm"):
            if ":" not in self.kind:
                raise ConfigError(f"rollout.kind: {self.kind!r} is not native, vllm or an engine "
                                  "class of your own named 'package.module:Class'")
            engine_class(self.kind)
            if self.vllm:
                raise ValueError(f"rollout.vllm options are set but rollout.kind is "
                                 f"{self.kind}; pass your engine's arguments as rollout.options")
        elif self.options:
            raise ValueError(f"rollout.options are for an engine class of your own "
                             f"(rollout.kind: package.module:Class), not {self.kind}")
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {self.num_engines}")
        if self.placement == "colocated" and self.num_engines != 1:
            raise ValueError("rollout.num_engines applies to placement: separate; colocated "
                             "runs one engine per trainer rank")
        if self.sync_bucket_mb <= 0:
            raise ValueError(f"rollout.sync_bucket_mb must be > 0, got {self.sync_bucket_mb}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.placement != "separate":
            raise ValueError(f"rollout.max_staleness={self.max_staleness} generates while the "
                             "trainers update, which needs engines of their own: set "
                             "rollout.placement: separate")
        if "release_memory" in self.vllm:
            raise ValueError("rollout.vllm.release_memory: set rollout.release_memory instead")
        if self.kind == "native" and self.vllm:
            raise ValueError("rollout.vllm options are set but rollout.kind is native")


def engine_class(kind: str) -> type:
    """The engine class ``rollout.kind: package.module:Class`` names; a ConfigError naming the
    key when it is not a class with the protocol's methods."""
    cls = import_attribute(kind, "rollout.kind")
    missing = [m for m in ("generate", "update_weights", "logprobs", "release_memory",
                           "resume_memory") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = f"lacks {missing}" if isinstance(cls, type) else "is not a class"
        raise ConfigError(f"rollout.kind: {kind!r} {what}; name a class implementing "
                          "posttrain.rl.engine.RolloutEngine")
    return cls


# Name -> the environments that ship with posttrain, named as a user's are
# (``package.module:attribute``).
BUNDLED_ENVIRONMENTS = {"single_turn": "posttrain.rl.environment:SingleTurnEnvironment",
                        "retry": "posttrain.rl.environment:RetryEnvironment",
                        "tools": "posttrain.rl.tools:ToolEnvironment"}


@dataclass(frozen=True)
class EnvironmentConfig:
    """The ``environment:`` section: a bundled `kind` or a user `module` (``pkg.mod:attr``,
    a class or function making one episode's environment from `params`); `max_turns`
    assistant turns per episode at most; `max_total_tokens` tokens after the prompt (the
    model's and the environment's) at most, None: `max_turns` x the sampling budget;
    `max_workers` threads stepping environments in parallel (0: one per CPU core)."""

    kind: str | None = None
    module: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int | None = None
    max_workers: int = 0

    def __post_init__(self) -> None:
        if self.kind is not None and self.module is not None:
            raise ConfigError("environment: set kind (a bundled environment) or module (your "
                              "own, 'package.module:attribute'), not both")
        if self.max_turns < 1:
            raise ConfigError(f"environment.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"environment.max_total_tokens must be >= 1, got "
                              f"{self.max_total_tokens}")
        if self.max_workers < 0:
            raise ConfigError("environment.max_workers must be >= 0 (0: one per CPU core)")
        factory = self.factory()
        try:
            inspect.signature(factory).bind(**self.params)
        except TypeError as e:
            raise ConfigError(f"environment.params: {e} (for {self.name})") from None
        except ValueError:                  # no signature to check (a builtin): trust it
            pass
        check = getattr(factory, "check_params", None)    # what can only be checked here
        if check is not None:
            try:
                check(**self.params)
            except ValueError as e:
                raise ConfigError(f"environment.params ({self.name}): {e}") from None

    @property
    def name(self) -> str:
        return self.module or self.kind or "single_turn"

    @property
    def single_turn(self) -> bool:
        return self.name == "single_turn"

    @property
    def turns(self) -> int:
        """Assistant turns per episode at most (1 for the single-turn environment)."""
        return 1 if self.single_turn else self.max_turns

    def token_budget(self, max_new_tokens: int) -> int:
        """Tokens after the prompt an episode may hold, the model's and the environment's,
        given the sampling budget of one turn."""
        return self.max_total_tokens or self.turns * max_new_tokens

    def factory(self) -> Callable[..., Any]:
        """What makes one episode's environment (called with `params`)."""
        if self.module is not None:
            factory = import_attribute(self.module, "environment.module")
            if not callable(factory):
                raise ConfigError(f"environment.module: {self.module!r} is not callable (a "
                                  "class or function that makes an environment)")
            return factory
        if self.name not in BUNDLED_ENVIRONMENTS:
            raise ConfigError(f"environment.kind: {self.kind!r} is not a bundled environment "
                              f"({', '.join(sorted(BUNDLED_ENVIRONMENTS))}); name your own "
                              "with environment.module: 'package.module:attribute'")
        return import_attribute(BUNDLED_ENVIRONMENTS[self.name], "environment.kind")

    def make(self) -> Environment:
        return self.factory()(**self.params)


@dataclass(frozen=True)
class EventEpisodesConfig:
    """Sequence RL's ``events:`` section: how rows become histories, what may be generated."""

    prompt_events: int = 8                 # events of a row given as its history, at most
    cut: Literal["first", "random"] = "first"
    min_prompt_events: int = 1             # cut: random: the fewest events of a history
    seed: int = 0                          # cut: random: the draw of each row's cut
    generate_semantic_ids: bool = False    # completions may hold semantic-ID codes too

    def __post_init__(self) -> None:
        if self.prompt_events < 1:
            raise ValueError(f"events.prompt_events must be at least 1, got {self.prompt_events}")
        if not 1 <= self.min_prompt_events <= self.prompt_events:
            raise ValueError(f"events.min_prompt_events={self.min_prompt_events} must be in "
                             f"[1, events.prompt_events={self.prompt_events}]")

    def cut_length(self, index: int) -> int:
        """How many events row `index` (of its split, manifest order) gives as its history."""
        if self.cut == "first":
            return self.prompt_events
        span = self.prompt_events - self.min_prompt_events + 1
        u = random.Random(self.seed * 1_000_003 + index).random()
        return self.min_prompt_events + min(int(u * span), span - 1)
