"""Gemma 4's decoder block and per-layer input embeddings (the text model of Gemma4ForCausalLM).

A Gemma 4 block is a Gemma sandwich block (norms before and after attention and MLP) with three
additions, which is why it is a block of its own, composed from the shared parts (attention,
`FeedForward`, the MoE block of `models/moe.py`, RMSNorm), rather than `TransformerBlock` with
switches:

    a   = x + post_attn_norm(attn(attn_norm(x)))            attention: `layers.Attention`
    m   = mlp(mlp_norm(a))                                  dense MLP (double width on KV-sharing
                                                            layers with `double_wide_mlp`)
    m   = post_dense_norm(m) + post_moe_norm(moe(a, moe_norm(a)))    with experts only: routed
                                                            on a (the router norms it itself),
                                                            the experts read moe_norm(a)
    b   = a + post_mlp_norm(m)
    c   = b + post_per_layer_norm(per_layer_proj(act(per_layer_gate(b)) * p_i))   with PLE
    out = c * layer_scalar

`p_i` [B, T, P] is layer i's slice of the per-layer inputs (`PerLayerInputs`), computed once
per forward from the token ids and the scaled token embeddings. `layer_scalar` is a fixed
number per layer (a buffer in transformers): a parameter here that is never trained
(`requires_grad=False`), so that it loads, shards and saves by name like every weight.

Module names (the contract for LoRA, TP, FSDP and the bridge, `families/gemma4.py`):

    layers[i].attn_norm, attn, post_attn_norm        as in every family (`attn.{q,k,v,o}`,
                                                      `attn.{q,k}_norm`; no k / v / k_norm on
                                                      KV-sharing layers, no v with k_eq_v)
    layers[i].mlp_norm, mlp.{gate,up,down}, post_mlp_norm
    layers[i].post_dense_norm, moe_norm, post_moe_norm          with experts
    layers[i].moe.{router, router_scale, expert_scale, experts.{gate,up,down}}   with experts
    layers[i].per_layer_gate, per_layer_proj, post_per_layer_norm              with PLE
    layers[i].layer_scalar                            [1], frozen
    per_layer_inputs.{embed, proj, norm}              the model-level part of PLE

Tensor parallelism splits the attention by heads (each layer kind its own head count and
width) and the dense MLP by columns; the MoE block and the PLE projections stay replicated over
"tp" (`distributed/tensor_parallel.tp_plan`), as every family's MoE does.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.layers import (Attention, FeedForward, SharedKV, embedding,
                                     make_norm)
from posttrain.ops.attention import DocumentMask
from posttrain.ops.gated import gated

__all__ = ["Gemma4Block", "PerLayerInputs"]


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer input embeddings (PLE): every layer's [P] input per token.

        embed   nn.Embedding [per_layer_vocab, L * P]
        proj    nn.Linear [L * P, hidden]
        norm    RMSNorm [P]

        p = (norm(proj(e) * hidden ** -0.5) + embed(ids) * sqrt(P)) * 2 ** -0.5     [B, T, L, P]

    with e the scaled token embeddings; the norm acts on each layer's P values, and sqrt(P) is
    rounded to the model dtype as the token embedding's scale is (`Transformer.embed_tokens`).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        g = args.gemma4
        assert g is not None and g.per_layer_input_size > 0
        if args.vocab_size > g.per_layer_vocab_size:
            raise ConfigError(
                f"gemma4: the vocabulary has {args.vocab_size} tokens, but the per-layer input "
                f"embeddings only {g.per_layer_vocab_size} rows (vocab_size_per_layer_input); "
                "tokens added to a Gemma 4 tokenizer have no per-layer embedding: use one of "
                "its unused tokens instead")
        self.num_layers, self.size = args.num_layers, g.per_layer_input_size
        width = args.num_layers * g.per_layer_input_size
        self.embed = embedding(g.per_layer_vocab_size, width)
        self.proj = nn.Linear(args.hidden_size, width, bias=False)
        self.norm = make_norm(args, g.per_layer_input_size)

    def forward(self, input_ids_BT: torch.Tensor, embeds_BTH: torch.Tensor) -> torch.Tensor:
        """-> [B, T, L, P]."""
        B, T = input_ids_BT.shape
        scale = torch.tensor(self.size ** 0.5, dtype=torch.float32)
        tokens = self.embed(input_ids_BT)
        tokens = tokens * scale.to(device=tokens.device, dtype=tokens.dtype)
        context = self.proj(embeds_BTH) * embeds_BTH.shape[-1] ** -0.5
        context = self.norm(context.reshape(B, T, self.num_layers, self.size))
        return (context + tokens.reshape(B, T, self.num_layers, self.size)) * 2 ** -0.5


class Gemma4Block(nn.Module):
    """One Gemma 4 decoder layer (see the module docstring); `state` / `step` run it over a
    decode cache, as every block does (`posttrain.models.kv_cache`)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        g = args.gemma4
        assert g is not None
        H = args.hidden_size
        self.layer_id = layer_id
        self.layer_type = args.layer_type(layer_id)
        self.attn_norm = make_norm(args, H)
        self.attn = Attention(args, layer_id)
        self.post_attn_norm = make_norm(args, H)
        self.mlp_norm = make_norm(args, H)
        self.mlp = FeedForward(args, intermediate_size=args.mlp_size(layer_id))
        self.post_mlp_norm = make_norm(args, H)
        self.moe: nn.Module | None = None
        if args.num_experts:
            from posttrain.models.moe import MoEBlock
            self.post_dense_norm = make_norm(args, H)
            self.moe_norm = make_norm(args, H)
            self.moe = MoEBlock(args)
            self.post_moe_norm = make_norm(args, H)
        self.per_layer_gate: nn.Linear | None = None
        if g.per_layer_input_size:
            self.hidden_act = args.hidden_act
            self.per_layer_gate = nn.Linear(H, g.per_layer_input_size, bias=False)
            self.per_layer_proj = nn.Linear(g.per_layer_input_size, H, bias=False)
            self.post_per_layer_norm = make_norm(args, H)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """The layer scalar (1, as transformers initialises it)."""
        self.layer_scalar.fill_(1.0)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: DocumentMask | None = None, *, state: object = None,
                step: object = None, per_layer_input: torch.Tensor | None = None,
                shared_kv: SharedKV | None = None) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), rope, mask, state=state, step=step,
                      shared_kv=shared_kv)
        x = x + self.post_attn_norm(h)
        h = self.mlp(self.mlp_norm(x))
        if self.moe is not None:
            routed = self.moe(x, self.moe_norm(x))
            h = self.post_dense_norm(h) + self.post_moe_norm(routed)
        x = x + self.post_mlp_norm(h)
        if self.per_layer_gate is not None:
            assert per_layer_input is not None, "a Gemma 4 block with PLE needs its input"
            unit = gated(self.per_layer_gate(x), per_layer_input, self.hidden_act)
            x = x + self.post_per_layer_norm(self.per_layer_proj(unit))
        return x * self.layer_scalar
