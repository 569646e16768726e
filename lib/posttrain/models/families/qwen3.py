"""Qwen3 dense (Qwen3ForCausalLM): qk-norm, no biases, plain or scaled RoPE."""

from __future__ import annotations

from typing import Any

from posttrain.models.args import ModelArgs
from posttrain.models.families.base import (FamilyBridge, common_fields, parse_hf_config,
                                            sliding_fields, split_rope)


class Qwen3Bridge(FamilyBridge):
    family = "qwen3"
    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        theta, scaling = split_rope(cfg.rope_parameters, where="qwen3 config.json")
        return ModelArgs(
            family="qwen3",
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=True,
            hidden_act=cfg.hidden_act,
            **sliding_fields(cfg),
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        cfg["hidden_act"] = args.hidden_act
        if args.sliding_window is not None:
            cfg.update(use_sliding_window=True, sliding_window=args.sliding_window,
                       layer_types=list(args.layer_types or ()))
        return cfg
