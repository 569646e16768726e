"""GPT-OSS (GptOssForCausalLM): sparse MoE in every layer, attention sinks, alternating
sliding-window and full layers, YaRN RoPE.

Differences from the Llama shape: biased q/k/v/o projections; a learned sink logit per query
head in every attention softmax (`attn.sinks`); one RoPE (YaRN, cos/sin scaled by its attention
factor) for all layers; a biased router that takes the top k logits and softmaxes over those;
experts with biases and the clamped SwiGLU (`models/moe.py`).

Checkpoints store the experts of a layer fused, as transformers holds them in memory:

    mlp.experts.gate_up_proj       [E, H, 2I]   gate and up interleaved on the last dim
                                                (gate = [..., ::2], up = [..., 1::2])
    mlp.experts.gate_up_proj_bias  [E, 2I]      interleaved the same way
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

The native experts keep Qwen3-MoE's layout (`gate`, `up` [E, I, H], `down` [E, H, I], plus
`gate_bias`, `up_bias` [E, I], `down_bias` [E, H]), so `to_native_tensors` splits and transposes
on load and `to_hf_tensor` interleaves back on save, bit for bit. OpenAI's release stores the
expert matrices as MXFP4 (`*_blocks` / `*_scales`); `hf_io` dequantizes them (`models/mxfp4.py`)
before they get here.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from posttrain.models.args import ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge, common_fields,
                                            parse_hf_config, sliding_fields, split_rope)

GPT_OSS_LAYER_NAMES = {**COMMON_LAYER_NAMES, "mlp.router": "mlp.router"}
# native parameter in layers[i] -> HF tensor in model.layers[i]; a fused tensor holds two, in
# the order its last dim interleaves them
PARAMETERS = {
    "attn.sinks": "self_attn.sinks",
    "mlp.experts.gate": "mlp.experts.gate_up_proj",
    "mlp.experts.up": "mlp.experts.gate_up_proj",
    "mlp.experts.gate_bias": "mlp.experts.gate_up_proj_bias",
    "mlp.experts.up_bias": "mlp.experts.gate_up_proj_bias",
    "mlp.experts.down": "mlp.experts.down_proj",
    "mlp.experts.down_bias": "mlp.experts.down_proj_bias",
}
_HOLDS = {hf: [native for native, h in PARAMETERS.items() if h == hf]
          for hf in PARAMETERS.values()}
_INTERLEAVED = ("gate_up_proj", "gate_up_proj_bias")
_TRANSPOSED = ("gate_up_proj", "down_proj")      # [E, in, out] in HF, [E, out, in] native

_NATIVE_PARAM = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_PARAM = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class GptOssBridge(FamilyBridge):
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    architecture = "GptOssForCausalLM"
    layer_names = GPT_OSS_LAYER_NAMES

    def to_hf(self, native: str) -> str:
        m = _NATIVE_PARAM.match(native)
        if m and m.group(2) in PARAMETERS:
            return f"model.layers.{m.group(1)}.{PARAMETERS[m.group(2)]}"
        return super().to_hf(native)

    def native_names(self, hf: str) -> list[str]:
        m = _HF_PARAM.match(hf)
        if m and m.group(2) in _HOLDS:
            return [f"layers.{m.group(1)}.{name}" for name in _HOLDS[m.group(2)]]
        return super().native_names(hf)

    def to_native_tensors(self, hf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        kind = hf.rsplit(".", 1)[-1]
        parts = [tensor[..., ::2], tensor[..., 1::2]] if kind in _INTERLEAVED else [tensor]
        if kind in _TRANSPOSED:
            parts = [t.transpose(1, 2) for t in parts]
        return list(zip(self.native_names(hf), (t.contiguous() for t in parts), strict=True))

    def to_hf_tensor(self, hf: str, natives: dict[str, torch.Tensor]) -> torch.Tensor:
        kind = hf.rsplit(".", 1)[-1]
        parts = [natives[name] for name in self.native_names(hf)]
        if kind in _TRANSPOSED:
            parts = [t.transpose(1, 2) for t in parts]
        if kind in _INTERLEAVED:
            return torch.stack(parts, dim=-1).flatten(-2)
        (tensor,) = parts
        return tensor.contiguous()

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        theta, scaling = split_rope(cfg.rope_parameters, where="gpt_oss config.json")
        return ModelArgs(
            family="gpt_oss",
            **common_fields(cfg, vocab_multiple=vocab_multiple),
            rope_theta=theta,
            rope_scaling=scaling,
            hidden_act=cfg.hidden_act,
            **sliding_fields(cfg),
            num_experts=int(cfg.num_local_experts),
            num_experts_per_tok=int(cfg.num_experts_per_tok),
            moe_intermediate_size=int(cfg.intermediate_size),
            router_aux_loss_coef=float(cfg.router_aux_loss_coef),
            attention_sinks=True,
            router_bias=True,
            expert_bias=True,
            moe_routing="topk_softmax",
            swiglu_limit=float(cfg.swiglu_limit),
            swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        cfg = super().config_from_args(args)
        cfg.update(
            hidden_act=args.hidden_act,
            intermediate_size=args.moe_intermediate_size,
            num_local_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            router_aux_loss_coef=args.router_aux_loss_coef,
            swiglu_limit=args.swiglu_limit,
            swiglu_alpha=args.swiglu_alpha,
            sliding_window=args.sliding_window,
            layer_types=list(args.layer_types or ["full_attention"] * args.num_layers),
        )
        return cfg
