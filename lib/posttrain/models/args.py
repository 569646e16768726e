"""One architecture description for every native family.

`ModelArgs` is what the native definitions are built from. Family bridges (`families/*.py`)
translate a Hugging Face `config.json` into it and back; the FLOPs counter, LoRA, sharding and
the verifier read it. Fields for one family default to values that switch the feature off for the
others, so a Llama config never mentions sliding windows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Family = Literal["qwen3", "qwen3_moe", "llama", "gemma3", "gpt_oss", "qwen3_5", "qwen3_5_moe",
                 "deepseek_v3", "gemma4"]

# layer kinds (`ModelArgs.layer_types`); the token mixer of a layer follows from its kind
FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION = ("full_attention", "sliding_attention",
                                                       "linear_attention")


def pad_to_multiple(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n (multiple <= 1 means no padding)."""
    if multiple <= 1:
        return n
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class DeltaNetArgs:
    """The gated-DeltaNet linear-attention layers of Qwen3.5 (`models/deltanet.py`).

    Queries and keys have `num_k_heads` heads of `head_k_dim`, values and the output gate
    `num_v_heads` heads of `head_v_dim`; value head j reads key head j // (num_v_heads //
    num_k_heads). `conv_kernel` is the width of the causal depthwise convolution over q, k, v;
    `chunk_size` the block length of the chunked (training) form of the delta rule.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear attention: num_v_heads ({self.num_v_heads}) must be a "
                             f"multiple of num_k_heads ({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head latent attention (DeepSeek-V2/V3, `models/mla.py`).

    Keys and values are made from a compressed latent of `kv_lora_rank` per token; queries from
    one of `q_lora_rank` (None: straight from the hidden state). A query / key head is
    `qk_nope_head_dim` dims without position plus `qk_rope_head_dim` rotated ones (the key's
    rotated part is one per token, shared by every head); a value head is `v_head_dim`.
    `rope_interleave`: the rotated dims come in (even, odd) pairs rather than two halves.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Gemma4Args:
    """What Gemma 4's text model adds (`models/gemma4.py`, `families/gemma4.py`).

    Full-attention layers have their own head width and key/value head count
    (`global_head_dim`, `num_global_kv_heads`; sliding layers use the model's `head_dim`,
    `num_kv_heads`) and, with `attention_k_eq_v`, no value projection: their values are the key
    projection's output (normed without a scale, not rotated).

    Per-layer input embeddings (`per_layer_input_size` P > 0): a second embedding table
    [per_layer_vocab_size, num_layers * P] and a projection of the token embeddings give every
    layer a [P] input, which the layer gates in after its MLP (`gemma4.PerLayerInputs`).

    KV sharing: the last `num_kv_shared_layers` layers compute no keys and values; each reads
    those of the last earlier layer of its own kind (`ModelArgs.kv_source`), in training
    and from that layer's decode cache. With `double_wide_mlp` those layers' MLPs are twice
    `intermediate_size` wide.

    The MoE block, when the model has experts (`ModelArgs.num_experts`), runs beside the dense
    MLP of every layer, not in its place (`gemma4.Gemma4Block`).
    """

    global_head_dim: int
    num_global_kv_heads: int
    attention_k_eq_v: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False


@dataclass(frozen=True)
class ModelArgs:
    family: Family
    vocab_size: int                      # real vocabulary (tokenizer size); rows past it are padding
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None    # HF rope_parameters (linear, llama3, yarn)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False               # biases on gate/up/down (some Llama variants)
    qk_norm: bool = False                # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    hidden_act: str = "silu"             # "silu" or "gelu_pytorch_tanh" (Gemma)
    vocab_multiple: int = 64             # embedding/head rows padded to a multiple of this
    # Gemma 3
    sliding_window: int | None = None
    # per layer: "full_attention" | "sliding_attention" | "linear_attention"
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None          # rope base of sliding layers
    query_pre_attn_scalar: float | None = None     # attention scale = scalar ** -0.5
    embed_scale: bool = False            # multiply embeddings by sqrt(hidden_size)
    norm_offset: bool = False            # RMSNorm weight applied as (1 + w)
    norm_scale_fp32: bool = False        # RMSNorm multiplies by w in fp32, then casts (Gemma 4)
    sandwich_norm: bool = False          # extra post-attention / post-MLP norms
    final_logit_softcapping: float | None = None
    # Qwen3.5
    partial_rotary_factor: float = 1.0    # RoPE turns the first head_dim * factor dims only
    attn_output_gate: bool = False        # q projects to [q, gate] per head; out *= sigmoid(gate)
    linear_attention: DeltaNetArgs | None = None   # the "linear_attention" layers
    # DeepSeek-V3: every attention layer is multi-head latent attention; `head_dim` is then
    # its rotated part (qk_rope_head_dim), as in transformers' config
    latent_attention: MLAArgs | None = None
    # mixture of experts (Qwen3-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0    # weight of the load-balancing loss (models/moe.py)
    shared_expert_intermediate_size: int = 0   # an always-on dense expert beside the routed ones
    shared_expert_gate: bool = False     # its output scaled by sigmoid(Linear(hidden, 1)) (Qwen3.5)
    # GPT-OSS
    attention_sinks: bool = False        # a learned logit per head joins every softmax
    router_bias: bool = False
    expert_bias: bool = False            # biases on the stacked expert projections
    # "softmax_topk" (Qwen3-MoE) | "topk_softmax" (GPT-OSS) | "sigmoid_group_topk" (DeepSeek-V3)
    moe_routing: str = "softmax_topk"
    swiglu_limit: float | None = None    # experts use the clamped SwiGLU (models/moe.py) when set
    swiglu_alpha: float = 1.702
    # DeepSeek-V3 routing ("sigmoid_group_topk"): experts in `moe_num_groups` groups, a token
    # chooses among `moe_topk_groups` of them; routed outputs scaled by routed_scaling_factor
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Gemma 4 (MoE: the router reads rms_norm(x) * scale * hidden ** -0.5, and a learned scale
    # per expert multiplies its routing weight)
    router_input_scale: bool = False
    router_expert_scale: bool = False
    gemma4: Gemma4Args | None = None
    # anything a bridge needs to write config.json back unchanged
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the checkpoint directory the weights came from: tensors outside the text model of a
    # multimodal checkpoint (vision tower, ...) are copied from it on export
    hf_source_dir: str | None = field(default=None, compare=False, repr=False)

    @property
    def padded_vocab_size(self) -> int:
        return pad_to_multiple(self.vocab_size, self.vocab_multiple)

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    def is_sliding_layer(self, i: int) -> bool:
        return self.layer_type(i) == SLIDING_ATTENTION

    def is_linear_layer(self, i: int) -> bool:
        return self.layer_type(i) == LINEAR_ATTENTION

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE turns (all unless `partial_rotary_factor`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_shape(self, i: int) -> tuple[int, int]:
        """(key/value heads, head dim) of layer i's attention: the model's, except on Gemma 4's
        full-attention layers, which have their own."""
        g = self.gemma4
        if g is not None and self.layer_type(i) == FULL_ATTENTION:
            return g.num_global_kv_heads, g.global_head_dim
        return self.num_kv_heads, self.head_dim

    def rotary_dim_of(self, layer_type: str) -> int:
        """The RoPE table width of a kind of layer (`rotary_dim` at that kind's head dim)."""
        g = self.gemma4
        full = g is not None and layer_type == FULL_ATTENTION
        return int((g.global_head_dim if full else self.head_dim) * self.partial_rotary_factor)

    def k_eq_v(self, i: int) -> bool:
        """Whether layer i's values are its key projection's output (no value projection)."""
        return (self.gemma4 is not None and self.gemma4.attention_k_eq_v
                and self.layer_type(i) == FULL_ATTENTION)

    def kv_source(self, i: int) -> int | None:
        """The layer whose keys and values layer i reuses (Gemma 4's KV sharing: the last layer
        of the same kind before the shared ones), or None where it computes its own."""
        g = self.gemma4
        first_shared = self.num_layers - (g.num_kv_shared_layers if g is not None else 0)
        if i < first_shared:
            return None
        kind = self.layer_type(i)
        sources = [j for j in range(first_shared) if self.layer_type(j) == kind]
        if not sources:
            raise ValueError(f"layer {i} ({kind}) shares keys and values, but no earlier "
                             f"{kind} layer computes them")
        return sources[-1]

    def stores_kv(self, i: int) -> bool:
        """Whether a later layer reuses layer i's keys and values."""
        return any(self.kv_source(j) == i for j in range(i + 1, self.num_layers))

    def mlp_size(self, i: int) -> int:
        """The dense MLP width of layer i (Gemma 4's KV-sharing layers may double it)."""
        g = self.gemma4
        if g is not None and g.double_wide_mlp and self.kv_source(i) is not None:
            return 2 * self.intermediate_size
        return self.intermediate_size

    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


# The weight dtypes a config may name (model.dtype, export.dtype, a suite's dtype).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
