"""Qwen3.5 dense (`qwen3_5_text`, Qwen3_5ForCausalLM) and MoE (`qwen3_5_moe_text`); the released
multimodal checkpoints (`qwen3_5`, `qwen3_5_moe`: Qwen3_5[Moe]ForConditionalGeneration) train
their text model (`families.base.MultimodalBridge`).

Differences from Qwen3: three of every four layers (`layer_types`, default: every 4th is full
attention) are gated-DeltaNet linear attention (`models/deltanet.py`); the full-attention layers
gate their output (q projects every head to [query, gate]) and turn only the first 25% of each
head with RoPE (`partial_rotary_factor`); every RMSNorm except DeltaNet's gated one applies its
weight as (1 + w). The MoE variant has a routed MoE (softmax, top-k, renormalised) in every layer
plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

RoPE: the text model's multimodal RoPE ("mrope", sections over temporal / height / width
positions) reduces to plain RoPE when the three position ids are equal, as they are for text;
posttrain trains text, so it computes plain (partial) RoPE.

Checkpoint layout of a linear-attention layer, and the native split (`models/deltanet.py`):

    linear_attn.in_proj_qkv.weight   [2 Hk Dk + Hv Dv, hidden]  -> attn.q, attn.k, attn.v
    linear_attn.conv1d.weight        [2 Hk Dk + Hv Dv, 1, K]    -> attn.conv_q, conv_k, conv_v
    linear_attn.in_proj_z / in_proj_b / in_proj_a / out_proj    -> attn.z / b / a / o
    linear_attn.A_log, dt_bias, norm.weight                     -> attn.A_log, dt_bias, norm

Which layers are linear depends on the config, so the bridge is bound to one (`bind`).
`mtp.*` tensors (multi-token prediction) are kept for export, not trained.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.args import LINEAR_ATTENTION, DeltaNetArgs, ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge,
                                            MultimodalLayout, common_fields, parse_hf_config,
                                            split_rope)
from posttrain.models.families.qwen3_moe import PerExpertTensors

# native name inside layers[i].attn of a linear layer -> HF name inside model.layers[i].linear_attn
DELTANET_NAMES = {
    "q.weight": "in_proj_qkv.weight", "k.weight": "in_proj_qkv.weight",
    "v.weight": "in_proj_qkv.weight",
    "conv_q": "conv1d.weight", "conv_k": "conv1d.weight", "conv_v": "conv1d.weight",
    "z.weight": "in_proj_z.weight", "b.weight": "in_proj_b.weight",
    "a.weight": "in_proj_a.weight", "o.weight": "out_proj.weight",
    "A_log": "A_log", "dt_bias": "dt_bias", "norm.weight": "norm.weight",
}
_FUSED = {hf: [n for n, h in DELTANET_NAMES.items() if h == hf]
          for hf in ("in_proj_qkv.weight", "conv1d.weight")}
QWEN3_5_MOE_LAYER_NAMES = {
    **COMMON_LAYER_NAMES, "mlp.router": "mlp.gate",
    "mlp.shared.gate": "mlp.shared_expert.gate_proj", "mlp.shared.up": "mlp.shared_expert.up_proj",
    "mlp.shared.down": "mlp.shared_expert.down_proj", "mlp.shared_gate": "mlp.shared_expert_gate",
}

_NATIVE_MIXER = re.compile(r"^layers\.(\d+)\.attn\.(.+)$")
_HF_LINEAR = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$")


class Qwen3_5Bridge(FamilyBridge):
    family = "qwen3_5"
    model_types = ("qwen3_5_text",)
    architecture = "Qwen3_5ForCausalLM"
    multimodal_types = {"qwen3_5": MultimodalLayout("Qwen3_5ForConditionalGeneration")}

    def __init__(self) -> None:
        super().__init__()
        self.linear_layers: frozenset[int] | None = None     # set by `bind`
        self.split_sizes: tuple[int, int, int] = (0, 0, 0)   # q, k, v channels

    def bind(self, config: dict[str, Any]) -> "Qwen3_5Bridge":
        """A copy that knows which layers are linear attention and how the fused q/k/v tensors
        split (both follow from config.json)."""
        cfg = parse_hf_config(config)
        bound = copy.copy(self)
        bound.linear_layers = frozenset(i for i, t in enumerate(cfg.layer_types)
                                        if t == LINEAR_ATTENTION)
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        bound.split_sizes = (key_dim, key_dim,
                             cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        return bound

    def _linear(self, layer: int) -> bool:
        if self.linear_layers is None:
            raise PosttrainError("the qwen3_5 bridge maps names per layer kind: get it with "
                                 "bridge_for_config(config) or bridge_for_args(args)")
        return layer in self.linear_layers

    # ---- names -------------------------------------------------------------------------------
    def is_passthrough(self, hf: str) -> bool:
        return hf.startswith("mtp.")

    def to_hf(self, native: str) -> str:
        m = _NATIVE_MIXER.match(native)
        if m and self._linear(int(m.group(1))):
            if m.group(2) not in DELTANET_NAMES:
                raise PosttrainError(f"native parameter '{native}' has no {self.family} HF name")
            return f"model.layers.{m.group(1)}.linear_attn.{DELTANET_NAMES[m.group(2)]}"
        return super().to_hf(native)

    def to_native(self, hf: str) -> str | None:
        return self._only_native(hf)

    def native_names(self, hf: str) -> list[str]:
        if self.is_passthrough(hf):
            return []
        m = _HF_LINEAR.match(hf)
        if m is None:
            return [] if (native := super().to_native(hf)) is None else [native]
        layer, name = m.groups()
        if name in _FUSED:
            return [f"layers.{layer}.attn.{n}" for n in _FUSED[name]]
        inner = [n for n, h in DELTANET_NAMES.items() if h == name]
        if not inner:
            raise PosttrainError(f"checkpoint key '{hf}' is not part of a {self.family} model")
        return [f"layers.{layer}.attn.{inner[0]}"]

    def to_native_tensors(self, hf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        names = self.native_names(hf)
        if len(names) == 1:
            return [(names[0], tensor)]
        parts = tensor.split(list(self.split_sizes), dim=0)
        if hf.endswith("conv1d.weight"):
            parts = [p.squeeze(1) for p in parts]
        return list(zip(names, (p.contiguous() for p in parts), strict=True))

    def to_hf_tensor(self, hf: str, natives: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [natives[name] for name in self.native_names(hf)]
        if len(parts) == 1:
            return parts[0]
        if hf.endswith("conv1d.weight"):
            parts = [p.unsqueeze(1) for p in parts]
        return torch.cat(parts, dim=0)

    # ---- configs -----------------------------------------------------------------------------
    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        rope = dict(cfg.rope_parameters)
        factor = float(rope.pop("partial_rotary_factor", 1.0))
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        theta, scaling = split_rope(rope, where=f"{self.family} config.json")
        if cfg.attention_bias:
            raise ConfigError(f"{self.family} config.json: attention_bias is not supported")
        return ModelArgs(
            family=self.family,
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=True,
            norm_offset=True,
            hidden_act=cfg.hidden_act,
            layer_types=tuple(cfg.layer_types),
            partial_rotary_factor=factor,
            attn_output_gate=True,
            linear_attention=DeltaNetArgs(
                num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
                conv_kernel=cfg.linear_conv_kernel_dim),
            **self._moe_fields(cfg),
            hf_config=dict(config),
        )

    def _moe_fields(self, cfg: Any) -> dict[str, Any]:
        return {}

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        la = args.linear_attention
        assert la is not None
        cfg.update(
            hidden_act=args.hidden_act,
            layer_types=list(args.layer_types or ()),
            linear_conv_kernel_dim=la.conv_kernel, linear_key_head_dim=la.head_k_dim,
            linear_value_head_dim=la.head_v_dim, linear_num_key_heads=la.num_k_heads,
            linear_num_value_heads=la.num_v_heads,
        )
        cfg["rope_parameters"]["partial_rotary_factor"] = args.partial_rotary_factor
        return cfg


class Qwen3_5MoeBridge(PerExpertTensors, Qwen3_5Bridge):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text",)
    architecture = "Qwen3_5MoeForCausalLM"
    multimodal_types = {"qwen3_5_moe": MultimodalLayout("Qwen3_5MoeForConditionalGeneration")}
    layer_names = QWEN3_5_MOE_LAYER_NAMES

    def _moe_fields(self, cfg: Any) -> dict[str, Any]:
        return dict(num_experts=int(cfg.num_experts),
                    num_experts_per_tok=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.moe_intermediate_size),
                    norm_topk_prob=True,
                    router_aux_loss_coef=float(cfg.router_aux_loss_coef),
                    shared_expert_intermediate_size=int(cfg.shared_expert_intermediate_size),
                    shared_expert_gate=True)

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        del cfg["intermediate_size"]
        cfg.update(num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
                   moe_intermediate_size=args.moe_intermediate_size,
                   router_aux_loss_coef=args.router_aux_loss_coef,
                   shared_expert_intermediate_size=args.shared_expert_intermediate_size)
        return cfg
