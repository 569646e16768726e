"""A static, left-padded KV cache and the incremental forward of a native `Transformer` over it.

Layout. A batch of B rows shares one slot axis of `capacity` slots per layer
(keys/values [B, Hkv, capacity, head_dim]). Prompts are left-padded to a common length, so row b
holds padding in slots [0, pad_b) and its tokens from slot pad_b on; every decode step writes all
rows at the same slot, and the last prompt token of every row sits in the same slot. A token in
slot s of row b has RoPE position s - pad_b. A query in slot i may read key slot j when

    pad_b <= j <= i   and   i - window < j     (window: the layer's sliding window, if any)

which, since positions and slots differ by the same pad_b, is the causal / sliding-window rule of
`posttrain.ops.attention` in positions. Padding queries read only their own slot (their output is
never used; it keeps the softmax free of empty rows).

`forward_with_cache` reuses the model's own modules (`embed_tokens`, `rope`, `attn.q/k/v/o`,
`q_norm/k_norm`, norms, `mlp`), so LoRA-wrapped projections and MoE blocks work unchanged; it
mirrors `layers.Attention.forward` and `transformer.TransformerBlock.forward` step for step, which
tests/lib/rl/test_native_engine.py checks against full recomputation for every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.models.layers import apply_rope
from posttrain.models.transformer import Transformer
from posttrain.ops.attention import masked_attention

__all__ = ["KVCache", "forward_with_cache"]


@dataclass
class KVCache:
    """Per-layer keys and values [B, Hkv, capacity, D]; slots [0, length) are filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pad_B: torch.Tensor          # int64 [B]: left-padding slots of each row
    length: int = 0

    @classmethod
    def allocate(cls, model: Transformer, pad_B: torch.Tensor, capacity: int) -> "KVCache":
        args = model.args
        ref = model.embed.weight
        shape = (pad_B.shape[0], args.num_kv_heads, capacity, args.head_dim)
        keys = [torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                for _ in range(args.num_layers)]
        values = [torch.zeros_like(k) for k in keys]
        return cls(keys, values, pad_B.to(ref.device), 0)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def select(self, rows_B: torch.Tensor) -> "KVCache":
        """A cache holding only `rows_B` (int64 indices), in that order."""
        return KVCache([k.index_select(0, rows_B) for k in self.keys],
                       [v.index_select(0, rows_B) for v in self.values],
                       self.pad_B.index_select(0, rows_B), self.length)


def _attention_masks(model: Transformer, cache: KVCache, start: int, end: int,
                     ) -> dict[int | None, torch.Tensor]:
    """Boolean masks [B, 1, T, end] per distinct sliding window (None: full attention)."""
    device = cache.pad_B.device
    query_T = torch.arange(start, end, device=device)
    key_S = torch.arange(end, device=device)
    causal_TS = key_S[None] <= query_T[:, None]
    real_BS = key_S[None] >= cache.pad_B[:, None]
    self_TS = key_S[None] == query_T[:, None]
    masks = {}
    for window in {layer.attn.sliding_window for layer in model.layers}:
        allowed_TS = causal_TS if window is None else causal_TS & (key_S[None] > query_T[:, None]
                                                                   - window)
        masks[window] = ((allowed_TS[None] & real_BS[:, None]) | self_TS[None])[:, None]
    return masks


def _cached_attention(attn: torch.nn.Module, x_BTH: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                      values: torch.Tensor, start: int, end: int,
                      mask_B1TS: torch.Tensor) -> torch.Tensor:
    B, T, _ = x_BTH.shape
    q = attn.q(x_BTH).view(B, T, -1, attn.head_dim)
    k = attn.k(x_BTH).view(B, T, -1, attn.head_dim)
    v = attn.v(x_BTH).view(B, T, -1, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys[:, :, start:end] = k
    values[:, :, start:end] = v
    out = masked_attention(q, keys[:, :, :end], values[:, :, :end], mask_B1TS,
                           scale=attn.scale, sinks=getattr(attn, "sinks", None))
    return attn.o(out.transpose(1, 2).reshape(B, T, -1))


def forward_with_cache(model: Transformer, input_ids_BT: torch.Tensor,
                       cache: KVCache) -> torch.Tensor:
    """Run T new tokens per row at slots [cache.length, cache.length + T), store their keys and
    values, advance `cache.length`; returns the final-normed hidden states [B, T, hidden]."""
    B, T = input_ids_BT.shape
    start, end = cache.length, cache.length + T
    assert B == cache.pad_B.shape[0], (B, cache.pad_B.shape)
    assert end <= cache.capacity, f"KV cache full: {end} > {cache.capacity} slots"
    slots_T = torch.arange(start, end, device=input_ids_BT.device)
    position_ids_BT = (slots_T[None] - cache.pad_B[:, None]).clamp_min(0)
    h = model.embed_tokens(input_ids_BT)
    tables = {name: rope(position_ids_BT, h.dtype) for name, rope in model.rope.items()}
    masks = _attention_masks(model, cache, start, end)
    for i, layer in enumerate(model.layers):
        a = _cached_attention(layer.attn, layer.attn_norm(h), tables[layer.layer_type],
                              cache.keys[i], cache.values[i], start, end,
                              masks[layer.attn.sliding_window])
        if layer.post_attn_norm is not None:
            a = layer.post_attn_norm(a)
        h = h + a
        m = layer.mlp(layer.mlp_norm(h))
        if layer.post_mlp_norm is not None:
            m = layer.post_mlp_norm(m)
        h = h + m
    cache.length = end
    return model.norm(h)
