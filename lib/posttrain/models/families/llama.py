"""Llama 3.x (LlamaForCausalLM): llama3 RoPE scaling, optional attention/MLP biases."""

from __future__ import annotations

from typing import Any

from posttrain.models.args import ModelArgs
from posttrain.models.families.base import (FamilyBridge, common_fields, parse_hf_config,
                                            split_rope)


class LlamaBridge(FamilyBridge):
    family = "llama"
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        theta, scaling = split_rope(cfg.rope_parameters, where="llama config.json")
        return ModelArgs(
            family="llama",
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            hidden_act=cfg.hidden_act,
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        return {**super().config_from_args(args), "hidden_act": args.hidden_act,
                "mlp_bias": args.mlp_bias}
