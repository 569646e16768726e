"""Building one rank's model: the native definition of a Hugging Face checkpoint, laid out
on the device mesh and filled from the checkpoint shard by shard (`build_sharded`; an
architecture without a native definition goes through `posttrain.train.fallback_build`).

    meta model (HF config) -> grow the vocabulary -> LoRA (+ trainable tokens) -> loss root
      -> parallelize (TP, CP, EP, AC, compile, FSDP2) -> stream the HF tensors, each rank
         keeping its shard
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from posttrain.config.model import ModelConfig
from posttrain.distributed.env import build_mesh
from posttrain.distributed.materialize import materialize
from posttrain.distributed.parallelize import (ParallelConfig, param_device, parallelize,
                                               parallelize_frozen)
from posttrain.errors import ConfigError
from posttrain.models.args import DTYPES, ModelArgs
from posttrain.models.families.base import VOCAB_PARAMS
from posttrain.models.hf_io import grow_vocab_rows, iter_hf_tensors, load_hf
from posttrain.models.transformer import LMHead, Transformer, build_model

__all__ = ["build_sharded", "fit_vocab"]

log = logging.getLogger(__name__)


def build_sharded(model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir: str,
                  device: torch.device, loss_factory: Callable[[Transformer], nn.Module], *,
                  vocab_size: int | None = None, frozen: bool = False,
                  init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                  mesh: Any = None, added_tokens: Sequence[int] = ()
                  ) -> tuple[Transformer, nn.Module]:
    """The model of `hf_dir` inside `loss_factory(model)`, laid out on the device mesh and
    filled from the checkpoint, each rank reading only its shards (see the module docstring).

    `vocab_size` above the checkpoint's grows the embedding and head rows (tokens the data layer
    added); `model_cfg.lora` wraps the targets first. `frozen` builds a model that is only run
    forward without gradients (a KL reference): sharded the same way, no activation
    checkpointing, everything resharded after each forward. `init_missing(name, param)` fills
    parameters the checkpoint lacks (LoRA adapters, a custom head); without it they are an error.
    `mesh` is the device mesh to lay it out on (default: a new one from `parallel`).
    With LoRA, the vocabulary rows of `model_cfg.lora.trainable_tokens` (resolved ids) and
    `modules_to_save` train too (`posttrain.models.trainable_tokens`); `added_tokens` (the ids
    the tokenizer added) must be among them, or the build is refused.

    An architecture without a native definition trains through transformers
    (`posttrain.train.fallback_build`), with LoRA on its own Linear names.
    """
    from posttrain.models.auto import has_native_definition
    from posttrain.models.hf_io import read_hf_config
    if not has_native_definition(read_hf_config(hf_dir)):
        lora_cfg = model_cfg.lora
        if lora_cfg is not None and (added_tokens or lora_cfg.modules_to_save
                                     or lora_cfg.token_ids(())):
            raise ConfigError(f"model.lora: {hf_dir} has no native definition and trains "
                              "through transformers, where LoRA cannot train vocabulary rows "
                              "(model.lora.trainable_tokens / modules_to_save; the tokenizer "
                              f"added {len(added_tokens)} tokens); train without model.lora")
        from posttrain.train.fallback_build import build_fallback
        return build_fallback(model_cfg, parallel, hf_dir, loss_factory, vocab_size=vocab_size,
                               frozen=frozen, mesh=mesh, init_missing=init_missing)
    model = load_hf(hf_dir, on_meta=True, param_filter=lambda name: False,
                    vocab_multiple=model_cfg.vocab_multiple)
    ckpt_args = model.args
    if vocab_size is not None and vocab_size > ckpt_args.vocab_size:
        log.info("growing the vocabulary from %d to %d (tokens added by the tokenizer)",
                 ckpt_args.vocab_size, vocab_size)
        model = build_model(ckpt_args.replace(vocab_size=vocab_size), device="meta")
    if model_cfg.lora is not None:
        from posttrain.models.lora import apply_lora_settings
        apply_lora_settings(model, model_cfg.lora, model_cfg.lora.token_ids(added_tokens),
                            required=added_tokens)
    fp32 = model.fp32_names()    # DeepSeek-V3's router: not rounded to a bf16 model.dtype
    root = loss_factory(model)
    mesh = mesh if mesh is not None else build_mesh(parallel.dp_shard, parallel.tp,
                                                    parallel.dp_replicate, parallel.cp)
    root = (parallelize_frozen if frozen else parallelize)(model, mesh, parallel, root=root)
    dtype = DTYPES[model_cfg.dtype]
    # a custom head (a reward model's scalar projection) replaces the LM head: it is
    # initialized by `init_missing`, not read from the checkpoint
    custom_head = not isinstance(model.head, LMHead)
    tensors = ((name, fit_vocab(name, t, ckpt_args, model.args).to(
                    torch.float32 if name in fp32 else dtype))
               for name, t in iter_hf_tensors(hf_dir, ckpt_args)
               if not (custom_head and name.startswith("head.")))
    # under parallel.offload the shards live in host memory (FSDP2 copies them in to gather)
    materialize(root, param_device(parallel, device), tensors, prefix="model.",
                init_missing=init_missing)
    model.tie_weights()
    return model, root


def fit_vocab(name: str, t: torch.Tensor, ckpt: ModelArgs, model: ModelArgs) -> torch.Tensor:
    """`t` with its vocabulary rows grown from the checkpoint's vocabulary to the model's (tokens
    the tokenizer added); other tensors as they are."""
    if name not in VOCAB_PARAMS or ckpt.vocab_size == model.vocab_size:
        return t
    return grow_vocab_rows(t, ckpt.vocab_size, model.vocab_size, model.padded_vocab_size)
