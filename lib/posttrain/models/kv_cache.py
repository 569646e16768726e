"""A static, left-padded decode cache and the incremental forward of a native `Transformer`.

Layout. A batch of B rows shares one slot axis of `capacity` slots. Prompts are left-padded to a
common length, so row b holds padding in slots [0, pad_b) and its tokens from slot pad_b on;
every decode step writes all rows at the same slot, and the last prompt token of every row sits
in the same slot. A token in slot s of row b has RoPE position s - pad_b.

Each layer keeps the state its token mixer needs, made by the mixer itself (`new_state`):

- attention (`layers.Attention`): keys and values [B, Hkv, capacity, head_dim]. A query in slot
  i may read key slot j when  pad_b <= j <= i  and  i - window < j  (window: the layer's sliding
  window, if any), which, since positions and slots differ by the same pad_b, is the causal /
  sliding-window rule of `posttrain.ops.attention` in positions. Padding queries read only their
  own slot (their output is never used; it keeps the softmax free of empty rows).
- gated DeltaNet (`deltanet.GatedDeltaNet`): the last conv_kernel - 1 convolution inputs and the
  recurrent state [B, Hv, Dk, Dv]; the left padding is a document of its own in the prefill,
  so the prompt starts from a zero state exactly as an unpadded one does.
- multi-head latent attention (`mla.MultiHeadLatentAttention`): the compressed latent and the
  rotated shared key [B, capacity, kv_lora_rank + qk_rope_head_dim], read by all heads at once
  with kv_b absorbed into the queries and outputs; masks as for attention.
- a Gemma 4 layer that shares another layer's keys and values (`ModelArgs.kv_source`) keeps
  none: its source writes the step's keys into its own cache first and hands the filled slots
  on (`layers.SharedKV`), so the sharing layer reads the source's cache.

`forward_with_cache` runs the model's own blocks (`TransformerBlock.forward` with `state` and
`step`), so LoRA-wrapped projections and MoE blocks work unchanged, and there is one block
forward for training and decoding; tests/lib/rl/test_native_engine.py checks it against full
recomputation for every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from posttrain.models.transformer import Transformer

__all__ = ["AttentionState", "DecodeStep", "KVCache", "forward_with_cache"]


@dataclass
class AttentionState:
    """One attention layer's keys and values [B, Hkv, capacity, D]."""

    keys: torch.Tensor
    values: torch.Tensor

    def select(self, rows_B: torch.Tensor) -> "AttentionState":
        return AttentionState(self.keys.index_select(0, rows_B),
                              self.values.index_select(0, rows_B))


@dataclass(frozen=True)
class DecodeStep:
    """What every layer's cached forward shares in one call: the slots [start, end) being
    written, each row's left padding, and the attention masks [B, 1, T, end] per sliding
    window (None: full attention)."""

    start: int
    end: int
    pad_B: torch.Tensor
    masks: dict[int | None, torch.Tensor]

    def document_lengths(self) -> list[list[int]]:
        """The call's tokens as documents per row: in a prefill from slot 0 the left padding
        is a document of its own (so nothing carries from it into the prompt)."""
        T = self.end - self.start
        if self.start > 0:
            return [[T] for _ in range(self.pad_B.shape[0])]
        return [[int(p), T - int(p)] if 0 < int(p) < T else [T] for p in self.pad_B.tolist()]


@dataclass
class KVCache:
    """Per-layer decode state (`layers[i]`, made by each token mixer's `new_state`; None for a
    layer that reads another layer's keys and values, Gemma 4's KV sharing) over `capacity`
    slots; slots [0, length) are filled."""

    layers: list[Any]
    pad_B: torch.Tensor          # int64 [B]: left-padding slots of each row
    capacity: int
    length: int = 0

    @classmethod
    def allocate(cls, model: Transformer, pad_B: torch.Tensor, capacity: int) -> "KVCache":
        ref = model.embed.weight
        states = [layer.attn.new_state(pad_B.shape[0], capacity, dtype=ref.dtype,
                                       device=ref.device) for layer in model.layers]
        return cls(states, pad_B.to(ref.device), capacity, 0)

    def select(self, rows_B: torch.Tensor) -> "KVCache":
        """A cache holding only `rows_B` (int64 indices), in that order."""
        return KVCache([state.select(rows_B) if state is not None else None
                        for state in self.layers],
                       self.pad_B.index_select(0, rows_B), self.capacity, self.length)


def _attention_masks(model: Transformer, cache: KVCache, start: int, end: int,
                     ) -> dict[int | None, torch.Tensor]:
    """Boolean masks [B, 1, T, end] per distinct sliding window of the attention layers."""
    device = cache.pad_B.device
    query_T = torch.arange(start, end, device=device)
    key_S = torch.arange(end, device=device)
    causal_TS = key_S[None] <= query_T[:, None]
    real_BS = key_S[None] >= cache.pad_B[:, None]
    self_TS = key_S[None] == query_T[:, None]
    masks = {}
    for window in {getattr(layer.attn, "sliding_window", None) for layer in model.layers}:
        allowed_TS = causal_TS if window is None else causal_TS & (key_S[None] > query_T[:, None]
                                                                   - window)
        masks[window] = ((allowed_TS[None] & real_BS[:, None]) | self_TS[None])[:, None]
    return masks


def forward_with_cache(model: Transformer, input_ids_BT: torch.Tensor,
                       cache: KVCache) -> torch.Tensor:
    """Run T new tokens per row at slots [cache.length, cache.length + T), store what each layer
    needs, advance `cache.length`; returns the final-normed hidden states [B, T, hidden]."""
    B, T = input_ids_BT.shape
    start, end = cache.length, cache.length + T
    assert B == cache.pad_B.shape[0], (B, cache.pad_B.shape)
    assert end <= cache.capacity, f"KV cache full: {end} > {cache.capacity} slots"
    slots_T = torch.arange(start, end, device=input_ids_BT.device)
    position_ids_BT = (slots_T[None] - cache.pad_B[:, None]).clamp_min(0)
    h = model.embed_tokens(input_ids_BT)
    tables = {name: rope(position_ids_BT, h.dtype) for name, rope in model.rope.items()}
    step = DecodeStep(start, end, cache.pad_B, _attention_masks(model, cache, start, end))
    for layer, state, extra in zip(model.layers, cache.layers,
                                   model.block_inputs(input_ids_BT, h)):
        h = layer(h, tables[model.rope_key(layer.layer_type)], None, state=state, step=step,
                  **extra)
    cache.length = end
    return model.norm(h)
