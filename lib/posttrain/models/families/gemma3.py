"""Gemma 3 text (Gemma3ForCausalLM, model_type `gemma3_text`).

Differences from the Llama shape: RMSNorm weights applied as (1 + w); sandwich norms around
attention and MLP; embeddings scaled by sqrt(hidden) rounded to the model dtype; gelu-tanh MLP;
per-head q/k norm; attention scale query_pre_attn_scalar ** -0.5; sliding-window layers with
their own RoPE base (`rope_parameters["sliding_attention"]`), full layers with the global base
and its scaling; optional final-logit soft-capping.
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge,
                                            MultimodalLayout, common_fields, parse_hf_config,
                                            sliding_fields, split_rope)

GEMMA3_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


class Gemma3Bridge(FamilyBridge):
    family = "gemma3"
    model_types = ("gemma3_text",)
    architecture = "Gemma3ForCausalLM"
    layer_names = GEMMA3_LAYER_NAMES
    # the released 4B/12B/27B checkpoints: the text model trains, the vision tower and the
    # projector are kept for export (`families.base.MultimodalBridge`)
    multimodal_types = {"gemma3": MultimodalLayout("Gemma3ForConditionalGeneration",
                                                   text_prefix="language_model.model.",
                                                   head="language_model.lm_head.weight",
                                                   applies_final_softcap=False)}

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ConfigError("gemma3 config.json: use_bidirectional_attention is not supported")
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            # transformers' Gemma3Attention does not apply it either; keep outputs identical
            warnings.warn("gemma3 attn_logit_softcapping is ignored (as in transformers)")
        rope = cfg.rope_parameters
        theta, scaling = split_rope(rope["full_attention"], where="gemma3 full-attention rope")
        local_theta, local_scaling = split_rope(rope["sliding_attention"],
                                                where="gemma3 sliding-attention rope")
        if local_scaling is not None:
            raise ConfigError("gemma3 config.json: RoPE scaling on sliding layers is not supported")
        return ModelArgs(
            family="gemma3",
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            qk_norm=True,
            hidden_act=cfg.hidden_activation,
            **sliding_fields(cfg),
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            embed_scale=True,
            norm_offset=True,
            sandwich_norm=True,
            final_logit_softcapping=cfg.final_logit_softcapping,
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        scalar = args.query_pre_attn_scalar or args.head_dim
        del cfg["rope_parameters"]
        cfg.update(
            hidden_activation=args.hidden_act,
            query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
            sliding_window=args.sliding_window,
            layer_types=list(args.layer_types or ["full_attention"] * args.num_layers),
            final_logit_softcapping=args.final_logit_softcapping,
            rope_parameters={
                "full_attention": {**(args.rope_scaling or {"rope_type": "default"}),
                                   "rope_theta": args.rope_theta},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": args.rope_local_theta or args.rope_theta},
            },
        )
        return cfg
