"""Choosing and building a rollout engine from the config: native (CPU, tests), vLLM (GPU), or
your own (``rollout.kind: "package.module:Class"``, the contract in
`posttrain.rl.engine.RolloutEngine`).

vLLM is imported only when a vLLM engine is built, so the library, its tests and the CPU
pipeline never need it installed.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.rl import RolloutEngineConfig, engine_class
from posttrain.errors import ConfigError
from posttrain.models.args import DTYPES, ModelArgs
from posttrain.rl.engine import RolloutEngine

__all__ = ["RolloutEngineConfig", "build_rollout_engine", "load_engine"]


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
