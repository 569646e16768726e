"""Multi-head latent attention (MLA), the token mixer of DeepSeek-V2/V3 (DeepSeek-AI 2024,
arXiv:2405.04434 §2.1; arXiv:2412.19437 §2.1.1).

Module (`layers[i].attn`; names are the contract for LoRA, TP and the bridge, HF names after
the arrow):

    q_a       nn.Linear [q_lora_rank, hidden]        queries' latent      <- q_a_proj
    q_a_norm  RMSNorm [q_lora_rank]                                       <- q_a_layernorm
    q_b       nn.Linear [H * (Dn + Dr), q_lora_rank]                      <- q_b_proj
    q         nn.Linear [H * (Dn + Dr), hidden]      instead of q_a/q_b when q_lora_rank is None
    kv_a      nn.Linear [C + Dr, hidden]             latent + shared rope key <- kv_a_proj_with_mqa
    kv_a_norm RMSNorm [C]                                                 <- kv_a_layernorm
    kv_b      nn.Linear [H * (Dn + Dv), C]           per-head keys and values <- kv_b_proj
    o         nn.Linear [hidden, H * Dv]                                  <- o_proj

with C = kv_lora_rank, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim. Per token
x (positions restart at every document of a packed row):

    q        = q_b(q_a_norm(q_a(x)))  (or q(x)),  per head [q_nope (Dn), q_rope (Dr)]
    c, k_r   = kv_a(x) split [C, Dr];   c = kv_a_norm(c)
    k_nope, v = kv_b(c) per head split [Dn, Dv]
    k        = [k_nope, rope(k_r)]   (k_r one per token, the same for every head)
    q        = [q_nope, rope(q_rope)]
    out      = o(attention(q, k, v, scale))         causal, within the document

RoPE turns `qk_rope_head_dim` dims; with `rope_interleave` they come as (even, odd) pairs, which
is the half-split rotation of the dims reordered evens first (transformers'
`apply_rotary_pos_emb_interleave` returns that order; dot products do not depend on it). The
softmax scale is (Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with
`mscale_all_dim` (transformers' `yarn_apply_mscale`); YaRN's factor on cos and sin comes with
the rope tables (`layers.rope_attention_factor`). The two latent norms use eps 1e-6 whatever
`rms_norm_eps`, as transformers builds them.

Decoding caches the latent: per token the normed c and the rotated shared key, C + Dr numbers
instead of H (Dn + Dr + Dv). The cached forward absorbs kv_b into the query and the output
(§2.1.2 of the V2 paper): with kv_b's rows per head W_k [Dn, C] and W_v [Dv, C],

    score(t, s) = q_nope W_k . c_s + rope(q_rope) . k_r,s        (q_nope W_k: [C] per head)
    out_t       = W_v (sum_s p(t, s) c_s)

so every step reads the cache once for all heads (MQA over the latent), never expanding it.

Tensor parallelism splits by heads: q_b (or q) and kv_b column-wise, o row-wise; q_a, kv_a and
the two norms stay replicated. The shared rope key is read by every head, so on each rank its
gradient is only the local heads' share: `tp_shared_features` asks `parallelize` to sum the
gradient of kv_a's last Dr output features over "tp".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import MLAArgs, ModelArgs
from posttrain.models.layers import RMSNorm, apply_rope
from posttrain.ops import attention as attention_ops

__all__ = ["MLAState", "MultiHeadLatentAttention", "mla_softmax_scale"]

_LATENT_NORM_EPS = 1e-6    # transformers' DeepseekV3RMSNorm default, not rms_norm_eps


def mla_softmax_scale(mla: MLAArgs, scaling: dict[str, Any] | None) -> float:
    """(Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope is scaled and
    `mscale_all_dim` is set (transformers' `yarn_apply_mscale`)."""
    scale = mla.qk_head_dim ** -0.5
    scaling = scaling or {}
    m_all = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") != "default" and m_all:
        factor = scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


@dataclass
class MLAState:
    """Decode state of one MLA layer: per slot the normed latent and the rotated shared key,
    [B, capacity, C + Dr]."""

    latent: torch.Tensor

    def select(self, rows_B: torch.Tensor) -> "MLAState":
        return MLAState(self.latent.index_select(0, rows_B))


def _weight(layer: nn.Module) -> torch.Tensor:
    """The [out, in] matrix `layer` applies (an adapted layer's includes its update)."""
    effective = getattr(layer, "effective_weight", None)
    return effective() if effective is not None else layer.weight


class MultiHeadLatentAttention(nn.Module):
    """The MLA token mixer (see the module docstring)."""

    # tensor parallelism by heads (`posttrain.distributed.tensor_parallel.tp_plan`); `tp_colwise`
    # is set per instance (q_b, or q without a query latent)
    tp_colwise: tuple[str, ...] = ("q_b", "kv_b")
    tp_rowwise = ("o",)
    tp_head_modules: tuple[str, ...] = ()
    tp_head_params: tuple[str, ...] = ()
    tp_head_counts = ("num_heads",)
    # (replicated module, attribute): its last `attribute` output features are read by every
    # head, so their gradient is summed over "tp"
    tp_shared_features = (("kv_a", "qk_rope_head_dim"),)

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        mla = args.latent_attention
        if mla is None:
            raise ConfigError(f"layer {layer_id}: multi-head latent attention needs the model "
                              "args' latent_attention settings")
        if args.num_kv_heads != args.num_heads:
            raise ConfigError(f"multi-head latent attention makes a key and value per query "
                              f"head: num_key_value_heads ({args.num_kv_heads}) must equal "
                              f"num_attention_heads ({args.num_heads})")
        if args.sliding_window is not None or args.attention_sinks or args.qk_norm:
            raise ConfigError("multi-head latent attention has no sliding window, sinks or "
                              "q/k norms")
        self.num_heads = args.num_heads
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.v_head_dim, self.qk_head_dim = mla.v_head_dim, mla.qk_head_dim
        self.rope_interleave = mla.rope_interleave
        self.scale = mla_softmax_scale(mla, args.rope_scaling)
        hidden, bias, heads = args.hidden_size, args.attention_bias, args.num_heads
        if mla.q_lora_rank is None:
            self.q = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
            self.q_a = self.q_a_norm = self.q_b = None
            self.tp_colwise = ("q", "kv_b")
        else:
            self.q = None
            self.q_a = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b = nn.Linear(mla.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b = nn.Linear(self.kv_lora_rank,
                              heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)

    def _rope(self, x_BHTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              ) -> torch.Tensor:
        if self.rope_interleave:        # (even, odd) pairs -> evens then odds
            x_BHTD = torch.cat([x_BHTD[..., 0::2], x_BHTD[..., 1::2]], dim=-1)
        return apply_rope(x_BHTD, *rope)

    def _queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, H, T, Dn] and the rotated q_rope [B, H, T, Dr]."""
        B, T, _ = x.shape
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, self._rope(q_rope, rope)

    def _latent(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed latent c [B, T, C] and the rotated shared key [B, 1, T, Dr]."""
        B, T, _ = x.shape
        c, k_rope = self.kv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_norm(c), self._rope(k_rope.view(B, 1, T, -1), rope)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: attention_ops.DocumentMask | None = None, *, state: MLAState | None = None,
                step: Any = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. `mask`: the batch's mask of full-attention
        layers (None: one causal document per row); `state` / `step`: decode
        (`posttrain.models.kv_cache`)."""
        B, T, _ = x.shape
        q_nope, q_rope = self._queries(x, rope)
        c, k_rope = self._latent(x, rope)
        if state is not None:
            return self._forward_cached(q_nope, q_rope, c, k_rope, state, step)
        kv = self.kv_b(c).view(B, T, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if mask is None:
            mask = attention_ops.build_mask(None, B, T, x.device)
        out = attention_ops.attention(q, k, v, mask=mask, scale=self.scale)
        return self.o(out.transpose(1, 2).reshape(B, T, -1))

    def _forward_cached(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor,
                        k_rope: torch.Tensor, state: MLAState, step: Any) -> torch.Tensor:
        """Write this call's latents into `state` and attend over the cache with kv_b absorbed
        (module docstring)."""
        B, H, T, _ = q_nope.shape
        state.latent[:, step.start:step.end] = torch.cat([c, k_rope[:, 0]], dim=-1)
        w = _weight(self.kv_b).view(H, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_k, w_v = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("bhtn,hnc->bhtc", q_nope, w_k), q_rope], dim=-1)
        cache = state.latent[:, None, :step.end]                        # [B, 1, S, C + Dr]
        out = attention_ops.masked_attention(q, cache, cache[..., :self.kv_lora_rank],
                                             step.masks[None], scale=self.scale)
        out = torch.einsum("bhtc,hvc->bhtv", out, w_v)
        return self.o(out.transpose(1, 2).reshape(B, T, -1))

    def new_state(self, batch: int, capacity: int, *, dtype: torch.dtype,
                  device: torch.device) -> MLAState:
        """An empty latent cache of `capacity` slots."""
        return MLAState(torch.zeros(batch, capacity, self.kv_lora_rank + self.qk_rope_head_dim,
                                    dtype=dtype, device=device))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_head_dim={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}, rope_interleave={self.rope_interleave}")
