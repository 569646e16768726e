"""Gemma 4 text (Gemma4ForCausalLM, model_type `gemma4_text`); the multimodal checkpoints
(`gemma4`: Gemma4ForConditionalGeneration) train their text model, the vision and audio towers
kept for export (`families.base.MultimodalBridge`).

Differences from Gemma 3 (`models/gemma4.py` has the block): RMSNorm weights applied as w (not
1 + w), multiplied in fp32; attention scale 1 (q and k are normed per head); values normed
without a weight; full-attention layers with their own head width and key/value heads
(`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads` in older files) and,
with `attention_k_eq_v`, values from the key projection; "proportional" RoPE on full layers;
per-layer input embeddings; the last `num_kv_shared_layers` layers reuse earlier layers' keys
and values; an optional MoE block beside the dense MLP; a fixed `layer_scalar` per layer.

Checkpoint layout, where it is not one module to one module:

    experts.gate_up_proj    [E, 2I, H]  -> moe.experts.gate (rows :I), moe.experts.up (rows I:)
    experts.down_proj       [E, H, I]   -> moe.experts.down
    router.proj / scale / per_expert_scale   -> moe.router / moe.router_scale / moe.expert_scale
    embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm
                                        -> per_layer_inputs.{embed, proj, norm}

The k/v projections and norms of KV-sharing layers, which released checkpoints may carry but
transformers ignores, are not loaded (which layers share depends on the config: `bind`).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.models.args import FULL_ATTENTION, SLIDING_ATTENTION, Gemma4Args, ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge,
                                            MultimodalLayout, common_fields, parse_hf_config,
                                            split_rope)

GEMMA4_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
    "post_dense_norm": "post_feedforward_layernorm_1",
    "moe_norm": "pre_feedforward_layernorm_2",
    "post_moe_norm": "post_feedforward_layernorm_2",
    "moe.router": "router.proj",
    "per_layer_gate": "per_layer_input_gate",
    "per_layer_proj": "per_layer_projection",
    "post_per_layer_norm": "post_per_layer_input_norm",
}
# parameters in layers[i] that are not a module's weight -> HF tensor in model.layers[i]; the
# fused gate_up_proj holds two, gate rows first
PARAMETERS = {
    "layer_scalar": "layer_scalar",
    "moe.router_scale": "router.scale",
    "moe.expert_scale": "router.per_expert_scale",
    "moe.experts.gate": "experts.gate_up_proj",
    "moe.experts.up": "experts.gate_up_proj",
    "moe.experts.down": "experts.down_proj",
}
_HOLDS = {hf: [native for native, h in PARAMETERS.items() if h == hf]
          for hf in PARAMETERS.values()}
TOP = {
    "per_layer_inputs.embed.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_inputs.proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_inputs.norm.weight": "model.per_layer_projection_norm.weight",
}
_TOP_NATIVE = {hf: native for native, hf in TOP.items()}
# what a KV-sharing layer of a released checkpoint may hold and no model reads
_SHARED_LAYER_UNUSED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.",
                        "self_attn.v_norm.")

_NATIVE_PARAM = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_PARAM = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Gemma4Bridge(FamilyBridge):
    family = "gemma4"
    model_types = ("gemma4_text",)
    architecture = "Gemma4ForCausalLM"
    multimodal_types = {"gemma4": MultimodalLayout("Gemma4ForConditionalGeneration")}
    layer_names = GEMMA4_LAYER_NAMES

    def __init__(self) -> None:
        super().__init__()
        self.kv_shared_layers: frozenset[int] = frozenset()    # set by `bind`

    def bind(self, config: dict[str, Any]) -> "Gemma4Bridge":
        """A copy that knows which layers share keys and values (their k/v tensors, if the
        checkpoint has them, are not loaded)."""
        cfg = parse_hf_config(config)
        bound = copy.copy(self)
        shared = int(cfg.num_kv_shared_layers or 0)
        bound.kv_shared_layers = frozenset(range(cfg.num_hidden_layers - shared,
                                                 cfg.num_hidden_layers))
        return bound

    # ---- names -------------------------------------------------------------------------------
    def to_hf(self, native: str) -> str:
        if native in TOP:
            return TOP[native]
        m = _NATIVE_PARAM.match(native)
        if m and m.group(2) in PARAMETERS:
            return f"model.layers.{m.group(1)}.{PARAMETERS[m.group(2)]}"
        return super().to_hf(native)

    def to_native(self, hf: str) -> str | None:
        return self._only_native(hf)

    def native_names(self, hf: str) -> list[str]:
        if hf in _TOP_NATIVE:
            return [_TOP_NATIVE[hf]]
        m = _HF_PARAM.match(hf)
        if m:
            layer, name = int(m.group(1)), m.group(2)
            if layer in self.kv_shared_layers and name.startswith(_SHARED_LAYER_UNUSED):
                return []
            if name in _HOLDS:
                return [f"layers.{layer}.{native}" for native in _HOLDS[name]]
        native = super().to_native(hf)
        return [] if native is None else [native]

    def to_native_tensors(self, hf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        names = self.native_names(hf)
        if len(names) == 1:
            return [(names[0], tensor)]
        gate, up = tensor.chunk(2, dim=1)          # gate_up_proj [E, 2I, H]
        return list(zip(names, (gate.contiguous(), up.contiguous()), strict=True))

    def to_hf_tensor(self, hf: str, natives: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [natives[name] for name in self.native_names(hf)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    # ---- configs -----------------------------------------------------------------------------
    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise ConfigError("gemma4 config.json: use_bidirectional_attention 'all' is not "
                              "supported (posttrain trains causal language models)")
        layer_types = tuple(cfg.layer_types)
        shared = int(cfg.num_kv_shared_layers or 0)
        if shared >= cfg.num_hidden_layers:
            raise ConfigError(f"gemma4 config.json: num_kv_shared_layers={shared} leaves no "
                              "layer that computes keys and values")
        (kv_heads, head_dim), (global_kv_heads, global_head_dim) = _attention_shapes(cfg)
        rope = cfg.rope_parameters
        theta, scaling = split_rope(rope[FULL_ATTENTION], where="gemma4 full-attention rope")
        local_theta = None
        if SLIDING_ATTENTION in layer_types:
            local_theta, local_scaling = split_rope(rope[SLIDING_ATTENTION],
                                                    where="gemma4 sliding-attention rope")
            if local_scaling is not None:
                raise ConfigError("gemma4 config.json: RoPE scaling on sliding layers is not "
                                  "supported")
        base = cfg.per_layer_config[layer_types.index(SLIDING_ATTENTION)
                                    if SLIDING_ATTENTION in layer_types else 0]
        fields = {**common_fields(base, vocab_multiple=vocab_multiple),
                  "num_kv_heads": kv_heads, "head_dim": head_dim}
        ple = int(cfg.hidden_size_per_layer_input or 0)
        return ModelArgs(
            family="gemma4",
            **fields,
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            qk_norm=True,
            hidden_act=cfg.hidden_activation,
            layer_types=layer_types,
            sliding_window=(int(cfg.sliding_window) if SLIDING_ATTENTION in layer_types
                            else None),
            query_pre_attn_scalar=1.0,
            embed_scale=True,
            norm_scale_fp32=True,
            sandwich_norm=True,
            final_logit_softcapping=cfg.final_logit_softcapping,
            **_moe_fields(cfg),
            gemma4=Gemma4Args(
                global_head_dim=global_head_dim, num_global_kv_heads=global_kv_heads,
                attention_k_eq_v=bool(cfg.attention_k_eq_v), per_layer_input_size=ple,
                per_layer_vocab_size=int(cfg.vocab_size_per_layer_input) if ple else 0,
                num_kv_shared_layers=shared, double_wide_mlp=bool(cfg.use_double_wide_mlp)),
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        g = args.gemma4
        assert g is not None
        cfg = super().config_from_args(args)
        layer_types = list(args.layer_types or [FULL_ATTENTION] * args.num_layers)
        cfg.update(
            hidden_activation=args.hidden_act,
            sliding_window=args.sliding_window or 512,
            layer_types=layer_types,
            final_logit_softcapping=args.final_logit_softcapping,
            per_layer_config={str(i): {"head_dim": g.global_head_dim,
                                       "num_key_value_heads": g.num_global_kv_heads}
                              for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION},
            attention_k_eq_v=g.attention_k_eq_v,
            hidden_size_per_layer_input=g.per_layer_input_size,
            vocab_size_per_layer_input=g.per_layer_vocab_size or args.vocab_size,
            num_kv_shared_layers=g.num_kv_shared_layers,
            use_double_wide_mlp=g.double_wide_mlp,
            enable_moe_block=args.num_experts > 0,
            num_experts=args.num_experts or None,
            top_k_experts=args.num_experts_per_tok or None,
            moe_intermediate_size=args.moe_intermediate_size or None,
            rope_parameters={
                FULL_ATTENTION: {**(args.rope_scaling or {"rope_type": "default"}),
                                 "rope_theta": args.rope_theta},
                SLIDING_ATTENTION: {"rope_type": "default",
                                    "rope_theta": args.rope_local_theta or args.rope_theta},
            },
        )
        return cfg


def _attention_shapes(cfg: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """((kv heads, head dim) of the sliding layers, the same of the full layers), from the
    config's per-layer view; every layer of a kind must agree, and nothing else may vary."""
    extra = set(cfg.per_layer_attributes or ()) - {"head_dim", "num_key_value_heads"}
    if extra:
        raise ConfigError(f"gemma4 config.json: per_layer_config varies {sorted(extra)} by "
                          "layer, which the native model does not support")
    shapes: dict[str, set[tuple[int, int]]] = {}
    for i, kind in enumerate(cfg.layer_types):
        layer = cfg.per_layer_config[i]
        shape = (int(layer.num_key_value_heads or layer.num_attention_heads),
                 int(layer.head_dim))
        shapes.setdefault(kind, set()).add(shape)
    for kind, found in shapes.items():
        if len(found) > 1:
            raise ConfigError(f"gemma4 config.json: the {kind} layers have different head "
                              f"shapes {sorted(found)} (kv heads, head_dim); not supported")
    full = next(iter(shapes[FULL_ATTENTION])) if FULL_ATTENTION in shapes else None
    sliding = next(iter(shapes[SLIDING_ATTENTION])) if SLIDING_ATTENTION in shapes else full
    assert sliding is not None
    return sliding, full or sliding


def _moe_fields(cfg: Any) -> dict[str, Any]:
    if not cfg.enable_moe_block:
        return {}
    return dict(num_experts=int(cfg.num_experts), num_experts_per_tok=int(cfg.top_k_experts),
                moe_intermediate_size=int(cfg.moe_intermediate_size), norm_topk_prob=True,
                router_input_scale=True, router_expert_scale=True)
