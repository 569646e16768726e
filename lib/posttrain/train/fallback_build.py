"""The engine's build for an architecture without a native definition (`Engine`,
`build_sharded`): a transformers model behind the native interface
(`posttrain.models.fallback.HFCausalLM`), with LoRA on its own Linear names and the modules a
loss root adds around it, sharded with FSDP2 like a native model.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from posttrain.distributed.env import build_mesh
from posttrain.distributed.parallelize import ParallelConfig, parallelize, parallelize_frozen
from posttrain.errors import ConfigError
from posttrain.models.args import DTYPES
from posttrain.models.fallback import FallbackWarning, load_fallback

if TYPE_CHECKING:                       # the engine builds through this module
    from posttrain.train.engine import LoraSettings, ModelConfig

__all__ = ["build_fallback"]


def build_fallback(model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir: str,
                   loss_factory: Callable[[nn.Module], nn.Module], *, vocab_size: int | None,
                   frozen: bool, mesh: Any,
                   init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None
                   ) -> tuple[nn.Module, nn.Module]:
    """`build_sharded` for an architecture without a native definition: transformers'
    `AutoModelForCausalLM` behind the native interface (`posttrain.models.fallback`), sharded
    with FSDP2 over its decoder blocks and the loss root.

    Unlike the native path, every rank loads the whole checkpoint (on the CPU) before
    sharding, and there is no tensor parallelism, vocabulary growth or exact FLOPs formula.
    LoRA wraps the architecture's own Linear modules (`model.lora.targets` such as ``q_proj``;
    `posttrain.models.lora.apply_lora`), its adapters filled by `init_missing` as on the native
    path. Modules the loss root adds on the meta device (a reward model's scalar head, a native
    distillation teacher) get storage here: the model's own are filled by `init_missing`, the
    others (a teacher) by the recipe's `ready`. Rank 0 warns once with the list of what does
    not apply (`FallbackWarning`); a frozen copy of the same checkpoint does not warn again.
    """
    if parallel.tp > 1:
        raise ConfigError(f"parallel.tp={parallel.tp}: {hf_dir} has no native definition, so "
                          "there is no tensor-parallel plan for it; use parallel.tp: 1")
    with warnings.catch_warnings():
        if frozen or dist.get_rank() != 0:
            warnings.simplefilter("ignore", FallbackWarning)
        model = load_fallback(hf_dir, dtype=DTYPES[model_cfg.dtype],
                              vocab_multiple=model_cfg.vocab_multiple)
    if vocab_size is not None and vocab_size > model.real_vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but {hf_dir} has "
                          f"{model.real_vocab_size} rows; the transformers fallback cannot grow "
                          "the vocabulary")
    if model_cfg.lora is not None:
        _fallback_lora(model, model_cfg.lora, hf_dir, init_missing)
    if frozen:
        model.requires_grad_(False)
    root = loss_factory(model)
    _materialize_added(root, model, init_missing)
    mesh = mesh if mesh is not None else build_mesh(parallel.dp_shard, parallel.tp,
                                                    parallel.dp_replicate, parallel.cp)
    root = (parallelize_frozen if frozen else parallelize)(model, mesh, parallel, root=root)
    return model, root


def _fallback_lora(model: nn.Module, settings: LoraSettings, hf_dir: str,
                   init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
    """LoRA on a transformers model's own Linear names, adapters from `init_missing`."""
    from posttrain.models import lora
    cfg = lora.LoraConfig.of(settings, init_seed=0)
    try:
        lora.apply_lora(model, cfg)
    except ConfigError as e:
        raise ConfigError(f"model.lora.targets: {hf_dir} has no native definition and trains "
                          f"through transformers, so LoRA targets are its own Linear names: "
                          f"{e}") from e
    if init_missing is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora.is_adapter_name(name):
                    p.copy_(init_missing(name, p))


def _materialize_added(root: nn.Module, model: nn.Module,
                       init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
    """Give the meta-device modules `root` added around a loaded fallback `model` storage on the
    model's device; fill the model's own (e.g. a custom head) with `init_missing`."""
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if on_meta and init_missing is None:
        raise ConfigError(f"no value for the parameters {on_meta[:6]} the loss root added")
    device = model.embed.weight.device
    for module in root.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in on_meta:
            params[name].copy_(init_missing(name, params[name]))
