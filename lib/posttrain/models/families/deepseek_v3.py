"""DeepSeek-V3 (`deepseek_v3`, DeepseekV3ForCausalLM; DeepSeek-AI 2024, arXiv:2412.19437).

Differences from the Llama shape: every attention layer is multi-head latent attention
(`models/mla.py`: compressed KV, decoupled RoPE, YaRN with DeepSeek's mscale); the first
`first_k_dense_replace` layers have a dense MLP of `intermediate_size`, every later one a routed
MoE (`models/moe.py`, routing "sigmoid_group_topk": sigmoid scores, a score-correction bias for
choosing, group-limited top-k, `routed_scaling_factor`) plus `n_shared_experts` always-on
experts, run as one dense MLP of `n_shared_experts * moe_intermediate_size` without a gate.

Checkpoint layout (one layer; HF -> native):

    self_attn.q_a_proj / q_a_layernorm / q_b_proj      -> attn.q_a / q_a_norm / q_b
    self_attn.q_proj                                   -> attn.q     (q_lora_rank: null)
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm      -> attn.kv_a / kv_a_norm
    self_attn.kv_b_proj / o_proj                       -> attn.kv_b / attn.o
    mlp.{gate,up,down}_proj                            -> mlp.{gate,up,down}      (dense layers)
    mlp.gate.weight                                    -> mlp.router.weight       (fp32)
    mlp.gate.e_score_correction_bias                   -> mlp.e_score_correction_bias (fp32 buffer)
    mlp.experts.{e}.{gate,up,down}_proj.weight         -> mlp.experts.{gate,up,down} [E, ...]
    mlp.shared_experts.{gate,up,down}_proj             -> mlp.shared.{gate,up,down}

transformers keeps the router weight and the bias in fp32 in a bf16 model
(`_keep_in_fp32_modules_strict`); so does the native model (`Transformer.fp32_names`), on load,
save and weight sync. The released checkpoints carry the multi-token-prediction module as one
more layer (`model.layers.61.*` after 61 layers); layers past `num_hidden_layers` are kept for
export and not trained. `num_key_value_heads` must equal `num_attention_heads` (MLA has a key
and value per query head).

The router term of the training loss: transformers' DeepseekV3ForCausalLM adds none (its loss is
the cross-entropy; `router_logits` are returned only), so `router_aux_loss_coef` is 0 here.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.args import MLAArgs, ModelArgs
from posttrain.models.families.base import (COMMON_LAYER_NAMES, FamilyBridge, common_fields,
                                            parse_hf_config, split_rope)
from posttrain.models.families.qwen3_moe import PerExpertTensors

DEEPSEEK_V3_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "attn.q_a": "self_attn.q_a_proj", "attn.q_a_norm": "self_attn.q_a_layernorm",
    "attn.q_b": "self_attn.q_b_proj", "attn.kv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_a_norm": "self_attn.kv_a_layernorm", "attn.kv_b": "self_attn.kv_b_proj",
    "mlp.router": "mlp.gate",
    "mlp.shared.gate": "mlp.shared_experts.gate_proj",
    "mlp.shared.up": "mlp.shared_experts.up_proj",
    "mlp.shared.down": "mlp.shared_experts.down_proj",
}
SCORE_BIAS = "e_score_correction_bias"
_NATIVE_BIAS = re.compile(rf"^layers\.(\d+)\.mlp\.{SCORE_BIAS}$")
_HF_BIAS = re.compile(rf"^model\.layers\.(\d+)\.mlp\.gate\.{SCORE_BIAS}$")
_HF_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3Bridge(PerExpertTensors, FamilyBridge):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"
    layer_names = DEEPSEEK_V3_LAYER_NAMES

    def __init__(self) -> None:
        super().__init__()
        self.num_layers: int | None = None        # set by `bind`: later layers are MTP

    def bind(self, config: dict[str, Any]) -> "DeepseekV3Bridge":
        """A copy that knows how many layers the model has (the checkpoint's later ones are
        the multi-token-prediction module, kept for export)."""
        bound = copy.copy(self)
        bound.num_layers = int(parse_hf_config(config).num_hidden_layers)
        return bound

    # ---- names -------------------------------------------------------------------------------
    def is_passthrough(self, hf: str) -> bool:
        m = _HF_LAYER_INDEX.match(hf)
        return bool(m) and self.num_layers is not None and int(m.group(1)) >= self.num_layers

    def to_hf(self, native: str) -> str:
        m = _NATIVE_BIAS.match(native)
        if m:
            return f"model.layers.{m.group(1)}.mlp.gate.{SCORE_BIAS}"
        return super().to_hf(native)

    def to_native(self, hf: str) -> str | None:
        if self.is_passthrough(hf):
            return None
        m = _HF_BIAS.match(hf)
        if m:
            return f"layers.{m.group(1)}.mlp.{SCORE_BIAS}"
        return super().to_native(hf)

    # ---- configs -----------------------------------------------------------------------------
    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        cfg = parse_hf_config(config)
        where = "deepseek_v3 config.json"
        theta, scaling = split_rope(cfg.rope_parameters, where=where)
        heads = cfg.num_attention_heads
        kv_heads = cfg.num_key_value_heads or heads
        if kv_heads != heads:
            raise ConfigError(f"{where}: num_key_value_heads ({kv_heads}) must equal "
                              f"num_attention_heads ({heads}): multi-head latent attention "
                              "makes a key and value per query head")
        first_dense = int(cfg.first_k_dense_replace or 0)
        routed = int(cfg.n_routed_experts)
        fields = common_fields(cfg, vocab_multiple=vocab_multiple)
        fields["head_dim"] = int(cfg.qk_rope_head_dim)
        return ModelArgs(
            family="deepseek_v3",
            **fields,
            rope_theta=theta,
            rope_scaling=scaling,
            hidden_act=cfg.hidden_act,
            latent_attention=MLAArgs(
                kv_lora_rank=int(cfg.kv_lora_rank), q_lora_rank=cfg.q_lora_rank,
                qk_nope_head_dim=int(cfg.qk_nope_head_dim),
                qk_rope_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim),
                rope_interleave=bool(cfg.rope_interleave)),
            num_experts=routed,
            num_experts_per_tok=int(cfg.num_experts_per_tok),
            moe_intermediate_size=int(cfg.moe_intermediate_size),
            norm_topk_prob=bool(cfg.norm_topk_prob),
            mlp_only_layers=tuple(range(min(first_dense, cfg.num_hidden_layers))),
            shared_expert_intermediate_size=int(cfg.n_shared_experts or 0)
            * int(cfg.moe_intermediate_size),
            moe_routing="sigmoid_group_topk",
            moe_num_groups=int(cfg.n_group or 1),
            moe_topk_groups=int(cfg.topk_group or 1),
            routed_scaling_factor=float(cfg.routed_scaling_factor),
            hf_config=dict(config),
        )

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        mla = args.latent_attention
        assert mla is not None
        first_dense = len(args.mlp_only_layers)
        if args.mlp_only_layers != tuple(range(first_dense)):
            raise PosttrainError(f"deepseek_v3 has dense layers first only "
                                 f"(first_k_dense_replace); mlp_only_layers "
                                 f"{args.mlp_only_layers} is not a prefix")
        shared, inter = args.shared_expert_intermediate_size, args.moe_intermediate_size
        if shared % inter:
            raise PosttrainError(f"the shared experts' width {shared} is not a multiple of "
                                 f"moe_intermediate_size {inter} (n_shared_experts)")
        cfg = super().config_from_args(args)
        del cfg["head_dim"]                # transformers derives it (qk_rope_head_dim)
        cfg.update(
            hidden_act=args.hidden_act,
            kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim, rope_interleave=mla.rope_interleave,
            n_routed_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=inter, n_shared_experts=shared // inter,
            norm_topk_prob=args.norm_topk_prob, first_k_dense_replace=first_dense,
            n_group=args.moe_num_groups, topk_group=args.moe_topk_groups,
            routed_scaling_factor=args.routed_scaling_factor,
        )
        return cfg
