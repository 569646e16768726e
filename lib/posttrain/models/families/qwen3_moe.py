"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention with sparse mixture-of-experts MLPs.

Layer i is a MoE layer when `num_experts > 0`, i is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`; the others are dense MLPs of `intermediate_size`.
With `use_sliding_window`, transformers gives every layer the window, and so do we.

Checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...; transformers
5 fuses them in memory but saves this layout); the native model stacks them into
`mlp.experts.{gate,up,down}` [E, ...] on load and splits them again on save. The router is HF's
`mlp.gate`, native `mlp.router`.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.models.args import ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge, common_fields,
                                            parse_hf_config, split_rope)

QWEN3_MOE_LAYER_NAMES = {**COMMON_LAYER_NAMES, "mlp.router": "mlp.gate"}
EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

_NATIVE_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate|up|down)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def expert_slice_names(native: str, num_experts: int) -> list[str] | None:
    """The per-expert HF keys of a stacked native expert weight, in expert order (None for any
    other parameter). Shared by every family that stores experts one tensor each."""
    m = _NATIVE_EXPERTS.match(native)
    if m is None:
        return None
    layer, proj = m.groups()
    return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[proj]}.weight"
            for e in range(num_experts)]


def expert_slice(hf: str) -> tuple[str, int] | None:
    """HF per-expert key -> (the stacked native parameter, the expert index), else None."""
    m = _HF_EXPERT.match(hf)
    return (f"layers.{m.group(1)}.mlp.experts.{m.group(3)}", int(m.group(2))) if m else None


class PerExpertTensors:
    """Bridge mixin for checkpoints that store MoE experts one tensor each
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`), stacked into [E, ...] natively."""

    def hf_names(self, native: str, args: ModelArgs) -> list[str]:
        return expert_slice_names(native, args.num_experts) or super().hf_names(native, args)

    def stack_index(self, hf: str) -> int | None:
        found = expert_slice(hf)
        return found[1] if found else None

    def to_native(self, hf: str) -> str | None:
        found = expert_slice(hf)
        return found[0] if found else super().to_native(hf)

    def native_names(self, hf: str) -> list[str]:
        found = expert_slice(hf)
        return [found[0]] if found else super().native_names(hf)


class Qwen3MoeBridge(PerExpertTensors, FamilyBridge):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    architecture = "Qwen3MoeForCausalLM"
    layer_names = QWEN3_MOE_LAYER_NAMES

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        theta, scaling = split_rope(cfg.rope_parameters, where="qwen3_moe config.json")
        sliding: dict[str, Any] = {}
        if cfg.sliding_window is not None:        # None unless use_sliding_window
            sliding = dict(sliding_window=int(cfg.sliding_window),
                           layer_types=("sliding_attention",) * cfg.num_hidden_layers)
        return ModelArgs(
            family="qwen3_moe",
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=True,
            hidden_act=cfg.hidden_act,
            **sliding,
            num_experts=int(cfg.num_experts),
            num_experts_per_tok=int(cfg.num_experts_per_tok),
            moe_intermediate_size=int(cfg.moe_intermediate_size),
            norm_topk_prob=bool(cfg.norm_topk_prob),
            decoder_sparse_step=int(cfg.decoder_sparse_step),
            mlp_only_layers=tuple(int(i) for i in cfg.mlp_only_layers or ()),
            router_aux_loss_coef=float(cfg.router_aux_loss_coef),
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        cfg.update(
            hidden_act=args.hidden_act,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=args.router_aux_loss_coef,
        )
        if args.sliding_window is not None:
            cfg.update(use_sliding_window=True, sliding_window=args.sliding_window)
        return cfg
