"""Choosing and building a rollout engine from the config: native (CPU, tests), vLLM (GPU), or
your own (``rollout.kind: "package.module:Class"``, the contract in
`posttrain.rl.engine.RolloutEngine`).

vLLM is imported only when a vLLM engine is built, so the library, its tests and the CPU
pipeline never need it installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from posttrain.config.loader import import_attribute
from posttrain.errors import ConfigError
from posttrain.models.args import DTYPES, ModelArgs
from posttrain.rl.engine import RolloutEngine

__all__ = ["RolloutEngineConfig", "build_rollout_engine", "load_engine"]


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


def build_rollout_engine(cfg: RolloutEngineConfig, args: ModelArgs | None, hf_dir: str,
                         device: torch.device | str, dtype: torch.dtype = torch.float32,
                         seed: int = 0) -> RolloutEngine:
    """An engine holding the model of `args`. The native engine starts with random weights
    (the first weight sync fills them); vLLM loads `hf_dir`, which must have the trainer's
    vocabulary (then the sync replaces the weights in place).

    `args` None: `hf_dir` has no native definition and the trainer runs it through
    transformers; the native engine then decodes the same transformers model (loaded from
    `hf_dir`, the trainer's `FallbackWarning` not repeated), and vLLM is refused, since the
    weight sync has no vLLM names for its ``hf.`` parameters. An engine of your own (``kind:
    package.module:Class``) gets these arguments as keywords, `args` None included."""
    if args is None and cfg.kind in ("native", "vllm"):
        if cfg.kind == "vllm":
            raise ConfigError(f"rollout.kind: {cfg.kind}: {hf_dir} has no native definition "
                              "and trains through transformers, whose parameter names the "
                              "weight sync cannot map onto vLLM's; use rollout.kind: native")
        return _fallback_engine(cfg, hf_dir, device, dtype)
    if cfg.kind == "native":
        return native_engine(args, device, dtype, seed,
                             max_batch_sequences=cfg.max_batch_sequences)
    if cfg.kind != "vllm":
        return engine_class(cfg.kind)(args=args, hf_dir=hf_dir, device=device, dtype=dtype,
                                      seed=seed, **cfg.options)
    from posttrain.rl.vllm_engine import VLLMEngine
    release = cfg.release_memory and cfg.placement == "colocated"
    return VLLMEngine(hf_dir, seed=seed, release_memory=release, **cfg.vllm)


def native_engine(args: ModelArgs, device: torch.device | str, dtype: torch.dtype = torch.float32,
                  seed: int = 0, *, max_batch_sequences: int = 256) -> RolloutEngine:
    """The native engine over a model of `args` with random weights (seeded by `seed`; the
    first weight sync fills them). An engine of your own may wrap one."""
    from posttrain.models.transformer import build_model
    from posttrain.rl.native import NativeEngine
    torch.manual_seed(seed)
    model = build_model(args, device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return NativeEngine(model, max_batch_sequences=max_batch_sequences)


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


def _fallback_engine(cfg: RolloutEngineConfig, hf_dir: str, device: torch.device | str,
                     dtype: torch.dtype) -> RolloutEngine:
    import warnings

    from posttrain.models.fallback import FallbackWarning, load_fallback
    from posttrain.rl.native import NativeEngine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        model = load_fallback(hf_dir, device=device, dtype=dtype, check=False).eval()
    model.requires_grad_(False)
    return NativeEngine(model, max_batch_sequences=cfg.max_batch_sequences)


def load_engine(cfg: RolloutEngineConfig, hf_dir: str, *, dtype: str = "float32", seed: int = 0,
                model: Any = None) -> RolloutEngine:
    """An engine serving the weights of the HF checkpoint `hf_dir`, for evaluation.

    vLLM loads `hf_dir` itself; the native engine generates with `model` when given (a native
    `Transformer`, or the transformers fallback's `HFCausalLM`, already loaded from `hf_dir`,
    whose weights it shares), else loads `hf_dir` on the GPU if there is one, in `dtype`. An
    engine of your own is built as in training and given those weights by `update_weights`.
    """
    if cfg.kind == "vllm":
        from posttrain.rl.vllm_engine import VLLMEngine
        return VLLMEngine(hf_dir, seed=seed, **cfg.vllm)
    from posttrain.rl.native import NativeEngine
    if model is None:                  # native, or the transformers fallback (`load_model`)
        from posttrain.models.auto import load_model
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = DTYPES[dtype]
        model = load_model(hf_dir, device=device, dtype=torch_dtype).eval()
    if cfg.kind != "native":
        from posttrain.distributed.materialize import persistent_buffers
        weight = next(model.parameters())
        engine = build_rollout_engine(cfg, getattr(model, "args", None), hf_dir, weight.device,
                                      weight.dtype, seed=seed)
        engine.update_weights([*model.named_parameters(), *persistent_buffers(model).items()])
        return engine
    return NativeEngine(model, max_batch_sequences=cfg.max_batch_sequences)
