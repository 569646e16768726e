"""The native decoder-only transformer shared by Qwen3, Llama 3.x, Gemma 3 (text), Qwen3-MoE,
GPT-OSS, Qwen3.5 (dense and MoE), DeepSeek-V3 and Gemma 4 (text).

Module tree (names are the contract for LoRA, sharding and the HF name maps):

    embed                       nn.Embedding [padded_vocab, hidden]
    layers[i].attn_norm         RMSNorm
    layers[i].attn              the layer's token mixer, by its kind (`args.layer_types`):
                                attention (`layers.Attention`) on full and sliding layers,
                                gated DeltaNet (`deltanet.GatedDeltaNet`) on linear ones,
                                multi-head latent attention (`mla.MultiHeadLatentAttention`)
                                with `args.latent_attention` (DeepSeek-V3)
    layers[i].attn.{q,k,v,o}    nn.Linear   (+ q_norm, k_norm with qk-norm families)
    layers[i].attn.{q_a,q_a_norm,q_b,kv_a,kv_a_norm,kv_b,o}   MLA's projections and latent norms
    layers[i].attn.sinks        Parameter [heads]   (GPT-OSS attention sinks only)
    layers[i].attn.{z,a,b}      nn.Linear   (DeltaNet: output gate, decay and write strength)
    layers[i].post_attn_norm    RMSNorm     (Gemma sandwich norms only)
    layers[i].mlp_norm          RMSNorm
    layers[i].mlp               dense: {gate,up,down}; MoE: router + experts (models/moe.py),
                                shared expert `shared`, DeepSeek's `e_score_correction_bias`
    layers[i].post_mlp_norm     RMSNorm     (Gemma sandwich norms only)
    norm                        RMSNorm
    per_layer_inputs            Gemma 4's per-layer input embeddings (`gemma4.PerLayerInputs`);
                                its blocks are `gemma4.Gemma4Block` (PLE and the MoE beside the
                                dense MLP, named there)
    head                        LMHead [padded_vocab, hidden] (tied to embed when configured),
                                or any module mapping hidden [B,T,H] -> [B,T,*]

`model(input_ids, position_ids, document_lengths)` returns the final-normed hidden states; the
loss (chunked cross-entropy over `head.weight`) is computed outside, `model.logits(hidden)`
gives full logits where they are needed (verification, sampling).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ModelArgs
from posttrain.models.layers import (Attention, FeedForward, RMSNorm, RotaryEmbedding, SharedKV,
                                     embedding, make_norm, position_ids_from_documents)
from posttrain.ops.attention import DocumentMask, build_mask
from posttrain.ops.vocab import mask_padded_logits

MLPFactory = Callable[[ModelArgs, int], nn.Module]
"""Builds `layers[i].mlp` from the model args and the layer index."""

FULL, SLIDING, LINEAR = FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION


def build_mixer(args: ModelArgs, layer_id: int) -> nn.Module:
    """`layers[i].attn`: the token mixer of the layer's kind. Every mixer takes
    `(x, rope, mask, *, state=None, step=None)` and makes its own decode state (`new_state`)."""
    if args.is_linear_layer(layer_id):
        from posttrain.models.deltanet import GatedDeltaNet
        return GatedDeltaNet(args, layer_id)
    if args.latent_attention is not None:
        from posttrain.models.mla import MultiHeadLatentAttention
        return MultiHeadLatentAttention(args, layer_id)
    return Attention(args, layer_id)


def default_mlp_factory(args: ModelArgs, layer_id: int) -> nn.Module:
    """Dense `FeedForward`, or the MoE block of `posttrain.models.moe` on MoE layers."""
    if args.is_moe_layer(layer_id):
        try:
            from posttrain.models import moe
        except ImportError as exc:
            raise ConfigError(
                f"layer {layer_id} of this {args.family} model is a mixture-of-experts layer, "
                "but posttrain.models.moe is not available") from exc
        return moe.build_moe(args, layer_id)
    return FeedForward(args)


class TransformerBlock(nn.Module):
    """Pre-norm block; with `args.sandwich_norm` also post-norms each branch (Gemma 3).

    `state` / `step` run it incrementally over a decode cache (`posttrain.models.kv_cache`)."""

    def __init__(self, args: ModelArgs, layer_id: int,
                 mlp_factory: MLPFactory = default_mlp_factory):
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = args.layer_type(layer_id)
        self.attn_norm = make_norm(args, args.hidden_size)
        self.attn = build_mixer(args, layer_id)
        self.mlp_norm = make_norm(args, args.hidden_size)
        self.mlp = mlp_factory(args, layer_id)
        if args.sandwich_norm:
            self.post_attn_norm = make_norm(args, args.hidden_size)
            self.post_mlp_norm = make_norm(args, args.hidden_size)
        else:
            self.post_attn_norm = self.post_mlp_norm = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: DocumentMask | None = None, *, state: object = None,
                step: object = None) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), rope, mask, state=state, step=step)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


def build_block(args: ModelArgs, layer_id: int, mlp_factory: MLPFactory) -> nn.Module:
    """`layers[i]`: a `TransformerBlock`, or Gemma 4's block (`models/gemma4.py`), which builds
    its dense MLP and its MoE block itself."""
    if args.gemma4 is not None:
        if mlp_factory is not default_mlp_factory:
            raise ConfigError("gemma4 blocks build their own dense MLP and MoE block; a custom "
                              "mlp_factory is not supported for them")
        from posttrain.models.gemma4 import Gemma4Block
        return Gemma4Block(args, layer_id)
    return TransformerBlock(args, layer_id, mlp_factory)


class LMHead(nn.Module):
    """Output projection over the padded vocabulary.

    Columns at or past `real_vocab_size` are padding (kept so the matrix shards evenly); their
    logits are set to -inf so they never get probability. `softcap` is Gemma's final-logit
    soft-capping, `cap * tanh(logits / cap)`; a loss computed from `weight` directly must apply
    it too.
    """

    def __init__(self, hidden_size: int, padded_vocab_size: int, real_vocab_size: int,
                 softcap: float | None = None):
        super().__init__()
        assert real_vocab_size <= padded_vocab_size
        self.real_vocab_size = real_vocab_size
        self.softcap = softcap
        self.weight = nn.Parameter(torch.empty(padded_vocab_size, hidden_size))

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Read the weight from `embedding` instead of owning one.

        The head then has no parameter of its own, so there is exactly one tensor to shard,
        materialize (`to_empty` would otherwise untie two parameter objects) and checkpoint.
        The embedding is held by reference, not as a submodule, so names do not change.
        """
        self._parameters.pop("weight", None)
        self.__dict__["_tied_embedding"] = embedding

    def read_rows_from(self, rows: nn.Module) -> None:
        """Read `weight` with some rows trained apart: `rows.apply(W)` (a
        `posttrain.models.trainable_tokens.TokenRows`, held by reference like a tied
        embedding), so losses that read `head.weight` see them."""
        self.__dict__["_token_rows"] = rows

    def _own_weight(self) -> torch.Tensor:
        tied = self.__dict__.get("_tied_embedding")
        return tied.weight if tied is not None else super().__getattr__("weight")

    def __getattr__(self, name: str):
        if name == "weight" and ("_tied_embedding" in self.__dict__
                                 or "_token_rows" in self.__dict__):
            rows = self.__dict__.get("_token_rows")
            return self._own_weight() if rows is None else rows.apply(self._own_weight())
        return super().__getattr__(name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return mask_padded_logits(logits, self.real_vocab_size)

    def extra_repr(self) -> str:
        return (f"{tuple(self._own_weight().shape)}, real_vocab_size={self.real_vocab_size}, "
                f"softcap={self.softcap}")


class Transformer(nn.Module):
    """Decoder-only LM body + replaceable head, built from `ModelArgs` for one device."""

    def __init__(self, args: ModelArgs, mlp_factory: MLPFactory = default_mlp_factory):
        super().__init__()
        self.args = args
        self.embed = embedding(args.padded_vocab_size, args.hidden_size)
        self.rope = nn.ModuleDict({FULL: RotaryEmbedding(args.rotary_dim_of(FULL),
                                                         args.rope_theta, args.rope_scaling)})
        if any(args.is_sliding_layer(i) for i in range(args.num_layers)):
            if args.rope_local_theta is not None:
                self.rope[SLIDING] = RotaryEmbedding(args.rotary_dim_of(SLIDING),
                                                     args.rope_local_theta)
            else:
                assert args.rotary_dim_of(SLIDING) == args.rotary_dim_of(FULL)
                self.rope[SLIDING] = self.rope[FULL]
        self.per_layer_inputs: nn.Module | None = None
        if args.gemma4 is not None and args.gemma4.per_layer_input_size:
            from posttrain.models.gemma4 import PerLayerInputs
            self.per_layer_inputs = PerLayerInputs(args)
        self.layers = nn.ModuleList(
            build_block(args, i, mlp_factory) for i in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        # set by `posttrain.distributed.apply_compile`: the blocks then get masks that do not
        # recompile them for a new packing (`ops.attention.build_mask(tensors_only=True)`)
        self.compiled_blocks = False
        # set by `posttrain.distributed.apply_context_parallel`: (rank, size, group) of the
        # "cp" group this model's rows are cut over (`posttrain.ops.context_parallel`)
        self.cp: tuple[int, int, Any] | None = None
        self.head: nn.Module = LMHead(args.hidden_size, args.padded_vocab_size, args.vocab_size,
                                      softcap=args.final_logit_softcapping)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share `embed.weight` with `head.weight` when the config ties them."""
        if self.args.tie_word_embeddings and isinstance(self.head, LMHead):
            self.head.tie_to(self.embed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.args.embed_scale:
            # Gemma rounds sqrt(hidden) to the model dtype before multiplying (55.4 -> 55.5 in bf16)
            scale = torch.tensor(self.args.hidden_size ** 0.5, dtype=torch.float32)
            h = h * scale.to(device=h.device, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_lengths: list[list[int]] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, hidden].

        `document_lengths[b]` lists the lengths of the documents packed into row b (summing to
        T); attention never crosses them. Without `position_ids`, positions restart at every
        document (or run 0..T-1 when no documents are given).

        With context parallelism (`cp` set), `input_ids` (and `position_ids`, if given) are
        this rank's T / cp tokens of each row (`CPShard.local`), `document_lengths` those of
        the whole rows, and the hidden states returned are this rank's tokens'.
        """
        B, T = input_ids.shape
        shard = self.context_shard(T)
        full = T if shard is None else shard.seq_len
        if position_ids is None:
            position_ids = (position_ids_from_documents(document_lengths, full, input_ids.device)
                            if document_lengths is not None
                            else torch.arange(full, device=input_ids.device).expand(B, full))
            if shard is not None:
                position_ids = shard.local(position_ids)
        h = self.embed_tokens(input_ids)
        tables = {name: rope(position_ids, h.dtype) for name, rope in self.rope.items()}
        masks = self.attention_masks(document_lengths, B, full, input_ids.device, cp=shard)
        for layer, extra in zip(self.layers, self.block_inputs(input_ids, h)):
            h = layer(h, tables[self.rope_key(layer.layer_type)], masks[layer.layer_type],
                      **extra)
        return self.norm(h)

    def block_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> list[dict[str, Any]]:
        """Each block's keyword inputs besides (h, rope, mask) in one forward or decode call:
        none, except on Gemma 4 its per-layer input [B, T, P] (`per_layer_input`) and the
        call's `SharedKV` through which layers share keys and values (`shared_kv`)."""
        if self.args.gemma4 is None:
            return [{} for _ in self.layers]
        shared = SharedKV()
        per_layer = (self.per_layer_inputs(input_ids, h)
                     if self.per_layer_inputs is not None else None)
        return [{"shared_kv": shared,
                 "per_layer_input": per_layer[:, :, i] if per_layer is not None else None}
                for i in range(len(self.layers))]

    def rope_key(self, layer_type: str) -> str:
        """The RoPE table a kind of layer reads (linear-attention layers read none; they get
        the full layers' table, which they ignore)."""
        return layer_type if layer_type in self.rope else FULL

    def context_shard(self, local_len: int) -> Any:
        """This rank's `CPShard` for rows of which it holds `local_len` tokens (None without
        context parallelism)."""
        if self.cp is None:
            return None
        from posttrain.ops.context_parallel import CPShard
        rank, size, group = self.cp
        return CPShard(rank, size, local_len * size, group)

    def attention_masks(self, document_lengths: list[list[int]] | None, batch: int,
                        seq_len: int, device: torch.device, *,
                        cp: Any = None) -> dict[str, DocumentMask]:
        """One mask per kind of layer (full, sliding, linear), built once per batch and shared
        by the layers; compiled blocks get masks that a new packing does not recompile them
        for (`compiled_blocks`: tensor masks on CUDA, the split run outside the graph on the
        CPU). Linear-attention layers read the documents from the
        `split` mask's lengths (their recurrence restarts at each document). With `cp` (this
        rank's `CPShard`), masks from this rank's queries to the whole rows' keys."""
        windows = {FULL: None}
        if SLIDING in self.rope:
            windows[SLIDING] = self.args.sliding_window
        masks = {kind: build_mask(document_lengths, batch, seq_len, device, sliding_window=window,
                                  tensors_only=self.compiled_blocks,
                                  sinks=self.args.attention_sinks, cp=cp)
                 for kind, window in windows.items()}
        if self.args.linear_attention is not None and cp is not None:
            raise ConfigError("context parallelism does not split gated-DeltaNet layers "
                              f"({self.args.family}); set parallel.cp=1")
        if self.args.linear_attention is not None:
            masks[LINEAR] = build_mask(document_lengths, batch, seq_len, device, backend="split")
        return masks

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> head output; [B, T, padded_vocab] for an `LMHead`."""
        return self.head(hidden)

    def moe_aux_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`router_aux_loss_coef` x the MoE load-balancing loss of the last forward (a zero
        scalar without MoE layers); see `posttrain.models.moe_balance.load_balancing_loss`."""
        from posttrain.models import moe_balance

        return moe_balance.moe_aux_loss(self, token_mask)

    def fp32_names(self) -> frozenset[str]:
        """Parameters and buffers held in fp32 whatever the model's dtype: those a module lists
        in `keep_fp32` (DeepSeek-V3's router weight and score-correction bias, which
        transformers keeps in fp32 too: `_keep_in_fp32_modules_strict`). Loading, saving,
        `build_model` and the weight sync keep them so."""
        return frozenset(f"{prefix}.{name}" for prefix, module in self.named_modules()
                         for name in getattr(module, "keep_fp32", ()))

    def to_dtype(self, dtype: torch.dtype) -> "Transformer":
        """`self.to(dtype)`, except for `fp32_names`; returns self."""
        self.to(dtype)
        for name in self.fp32_names():
            module_path, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_path)
            t = getattr(module, leaf)
            if t.dtype == torch.float32:
                continue
            if isinstance(t, nn.Parameter):
                module.register_parameter(leaf, nn.Parameter(t.float(),
                                                             requires_grad=t.requires_grad))
            else:
                module.register_buffer(leaf, t.float())
        return self

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init: normal(0, std) matrices, zero biases, unit norms, zero padding rows."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Embedding, LMHead)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif module is not self and hasattr(module, "init_weights"):
                module.init_weights()
        for weight in (self.embed.weight, getattr(self.head, "weight", None)):
            if weight is not None and weight.shape[0] == self.args.padded_vocab_size:
                weight[self.args.vocab_size:].zero_()


def build_model(args: ModelArgs, *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, seed: int | None = None,
                mlp_factory: MLPFactory = default_mlp_factory) -> Transformer:
    """A randomly initialised native model (`device="meta"` builds it without storage)."""
    with torch.device(device or "cpu"):
        model = Transformer(args, mlp_factory)
    if str(device) != "meta":
        if seed is not None:
            torch.manual_seed(seed)
        model.init_weights()
    if dtype is not None:
        model.to_dtype(dtype)
    return model
