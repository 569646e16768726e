"""Blocks shared by every native family: RMSNorm, rotary embeddings, attention, dense MLP.

Everything here is written for one device and plain tensors. Module and parameter names are
part of the contract: LoRA, sharding plans and the HF name maps (`families/*.py`) find modules by
them (`attn.q`, `attn.k`, `attn.v`, `attn.o`, `attn.q_norm`, `attn.k_norm`, `mlp.gate`,
`mlp.up`, `mlp.down`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.ops import attention as attention_ops
from posttrain.ops.gated import ACTIVATIONS, gated
from posttrain.ops.rms_norm import fusable, rms_norm_scaled


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32.

    `offset=False` (Llama, Qwen3): `w * norm(x).to(dtype)`, weight initialised to ones.
    `offset=True` (Gemma 2/3): `(norm(x) * (1 + w)).to(dtype)`, weight initialised to zeros.
    `scale_fp32=True` (Gemma 4): `(norm(x) * w).to(dtype)`, weight initialised to ones. The
    order of the cast differs between them on purpose; it is what the checkpoints were trained
    with.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False,
                 scale_fp32: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.scale_fp32 = scale_fp32
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fusable(x, self.weight):         # fp32: fewer tensors made and kept, same bits
            return rms_norm_scaled(x, 1.0 + self.weight if self.offset else self.weight,
                                   self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        if self.scale_fp32:
            return (normed * self.weight.float()).type_as(x)
        return self.weight * normed.type_as(x)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.offset else 1.0)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"
                + (", scale_fp32=True" if self.scale_fp32 else ""))


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """`nn.Embedding(num_embeddings, dim)`; under ``torch.device("meta")`` without its default
    normal init, whose meta kernel imports `torch._dynamo` (about 0.5 s in every process that
    builds a model on the meta device: the trainer ranks, the evaluation, the memory plan).
    A meta tensor holds no values, so nothing changes; on a real device the default init runs
    as before (the random stream stays the same)."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)


def make_norm(args: ModelArgs, dim: int) -> RMSNorm:
    """An RMSNorm over `dim` in the model's convention (`norm_offset`, `norm_scale_fp32`)."""
    return RMSNorm(dim, args.rms_norm_eps, offset=args.norm_offset,
                   scale_fp32=args.norm_scale_fp32)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32, cast back (Gemma 4's value norm and router norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                  ) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32, CPU) for plain, linear, llama3, yarn or
    proportional RoPE.

    `scaling` is the HF `rope_parameters` dict without its base (`rope_type`, `factor`, ...).
    "proportional" (Gemma 4's full layers) keeps the first `partial_rotary_factor` of the
    frequencies at their full-head exponents and sets the rest to zero, so that a table as wide
    as the head turns dims i and i + head_dim / 2 for the kept i and passes the others through
    (unlike `partial_rotary_factor` on `ModelArgs`, which turns a narrower leading block).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are interpolated by `factor`, short ones kept, the band between
        # is blended linearly in old_len / wavelen (Llama 3.1 "smooth" scaling)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, exponents)
    if rope_type == "proportional":
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        kept = torch.zeros(head_dim // 2, device="cpu")
        kept[:angles] = inv_freq[:angles]
        return kept / scaling.get("factor", 1.0)
    raise ConfigError(
        f"rope_type '{rope_type}' is not supported by the native models (supported: default, "
        "linear, llama3, yarn, proportional); add it to posttrain/models/layers.py:rope_inv_freq")


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any],
                   exponents: torch.Tensor) -> torch.Tensor:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as transformers
    computes it: frequencies that turn fewer than `beta_slow` times over the original context
    are interpolated by `factor`, those turning more than `beta_fast` times are kept, and a
    linear ramp over the dimension index blends the band between."""
    if scaling.get("factor") is None:
        raise ConfigError("yarn rope_parameters need a 'factor'")
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:   # the dimension whose frequency turns this often
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = dim_turning(scaling.get("beta_fast") or 32)
    high = dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** exponents
    kept = 1 - ramp                           # weight of the original frequency
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (its `attention_factor`, else
    0.1 ln(factor) + 1, or DeepSeek's mscale ratio), 1 for every other rope type."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given position ids.

    The inverse frequencies are a plain attribute computed on the CPU rather than a buffer:
    they survive building on the meta device and are never sharded or checkpointed.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.attention_factor = rope_attention_factor(scaling)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, head_dim] in `dtype`."""
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate q or k [B, H, T, D] by the half-split (GPT-NeoX / HF) convention. Tables narrower
    than the head (R < D, partial rotary) turn the first R dims and pass the rest through."""
    cos, sin = cos_BTR.unsqueeze(1), sin_BTR.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == x_BHTD.shape[-1]:
        return _rotate(x_BHTD, cos, sin)
    x_rot, x_pass = x_BHTD[..., :rotary], x_BHTD[..., rotary:]
    return torch.cat((_rotate(x_rot, cos, sin), x_pass), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, the second product and the sum written over the
    tensors just made for them (the same ops on the same values, two new tensors of x's size
    fewer: `posttrain.ops.gated` says why that pays on a CPU). Autograd keeps only the tables
    for these products, so the in-place ops leave nothing it saved; tables of another dtype
    (a promoting product) or with gradients take the plain expression."""
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.requires_grad or sin.requires_grad:
        return x * cos + _rotate_half(x) * sin
    return (x * cos).add_(_rotate_half(x).mul_(sin))


class SharedKV:
    """Keys and values that later layers reuse within one forward or decode call (Gemma 4's KV
    sharing, `ModelArgs.kv_source`): a source layer stores what it attends over (its keys and
    values [B, Hkv, S, D]; in decoding its cache up to the current slot), a sharing layer reads
    them. A plain object, not a dict, on purpose: FSDP2 and activation checkpointing rebuild the
    containers among a block's inputs that they flatten, so a dict passed to one block would not
    be the dict the next block reads."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class Attention(nn.Module):
    """Causal GQA self-attention with optional per-head q/k norm, a sliding window, attention
    sinks (`sinks` [H], GPT-OSS), partial RoPE and an output gate (Qwen3.5: `q` projects every
    head to [query, gate], and the attention output is multiplied by sigmoid(gate)).

    Gemma 4 adds: per-layer head shapes (`ModelArgs.attention_shape`), values normed without a
    weight, values taken from the key projection (`k_eq_v`: no `v`), and KV sharing: a layer
    with a `kv_source` has no `k`, `v` or `k_norm` and attends over its source layer's keys and
    values (`SharedKV`), in training and decoding alike.

    The kernel is `posttrain.ops.attention.attention`, which applies the causal mask, the
    document mask of packed rows and the sliding window itself. With `state` and `step`
    (`posttrain.models.kv_cache`) the layer runs incrementally over a KV cache instead.
    """

    # tensor parallelism by heads (`posttrain.distributed.tensor_parallel.tp_plan`); a layer without
    # `k` / `v` (KV sharing, k_eq_v) lists only the projections it has
    tp_colwise = ("q", "k", "v")
    tp_rowwise = ("o",)
    tp_head_modules = ("q_norm", "k_norm")
    tp_head_params = ("sinks",)
    tp_head_counts = ("num_heads", "num_kv_heads")

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = args.num_heads
        self.num_kv_heads, self.head_dim = args.attention_shape(layer_id)
        self.sliding_window = args.sliding_window if args.is_sliding_layer(layer_id) else None
        pre_scalar = args.query_pre_attn_scalar
        self.scale = (pre_scalar if pre_scalar is not None else self.head_dim) ** -0.5
        self.kv_source = args.kv_source(layer_id)
        self.stores_kv = args.stores_kv(layer_id)
        self.value_norm_eps = args.rms_norm_eps if args.gemma4 is not None else None
        bias = args.attention_bias
        self.output_gate = args.attn_output_gate
        q_out = args.num_heads * self.head_dim * (2 if self.output_gate else 1)
        kv_out = self.num_kv_heads * self.head_dim
        self.q = nn.Linear(args.hidden_size, q_out, bias=bias)
        own_kv = self.kv_source is None
        self.k = nn.Linear(args.hidden_size, kv_out, bias=bias) if own_kv else None
        self.v = (nn.Linear(args.hidden_size, kv_out, bias=bias)
                  if own_kv and not args.k_eq_v(layer_id) else None)
        self.o = nn.Linear(args.num_heads * self.head_dim, args.hidden_size, bias=bias)
        self.tp_colwise = tuple(n for n in ("q", "k", "v") if getattr(self, n) is not None)
        self.q_norm = make_norm(args, self.head_dim) if args.qk_norm else None
        self.k_norm = make_norm(args, self.head_dim) if args.qk_norm and own_kv else None
        # GPT-OSS: a learned logit per query head in every softmax denominator
        self.sinks = nn.Parameter(torch.empty(args.num_heads)) if args.attention_sinks else None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """The sinks (the projections and norms are initialised as modules of their own)."""
        if self.sinks is not None:
            nn.init.normal_(self.sinks, std=std)

    def _project(self, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                            torch.Tensor | None]:
        """q [B, H, T, D], k and v [B, Hkv, T, D] (normed, rotated; None on a layer that reuses
        another's) and the gate [B, T, H*D]."""
        B, T, _ = x_BTH.shape
        cos, sin = rope
        q = self.q(x_BTH)
        gate = None
        if self.output_gate:
            q, gate = q.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        if self.k is None:
            return q, None, None, gate
        k = self.k(x_BTH).view(B, T, -1, self.head_dim)
        v = self.v(x_BTH).view(B, T, -1, self.head_dim) if self.v is not None else k
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.value_norm_eps is not None:
            v = rms_norm(v, self.value_norm_eps)
        return q, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), gate

    def _output(self, out_BHTD: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        B, _, T, _ = out_BHTD.shape
        out = out_BHTD.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out)

    def forward(self, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: attention_ops.DocumentMask | None = None, *, state: Any = None,
                step: Any = None, shared_kv: SharedKV | None = None) -> torch.Tensor:
        """`mask`: the batch's mask for this layer's kind (`Transformer.forward` builds it
        once); None is one causal document per row. `state` / `step`: this layer's
        `AttentionState` and the call's `DecodeStep` (`posttrain.models.kv_cache`; a layer
        that reuses another's keys and values has no state). `shared_kv`: the call's
        `SharedKV`, on models with KV sharing."""
        B, T, _ = x_BTH.shape
        q, k, v, gate = self._project(x_BTH, rope)
        if k is None:
            assert shared_kv is not None, "a KV-sharing layer needs the call's SharedKV"
            k, v = shared_kv.kv[self.kv_source]
        elif state is not None:
            state.keys[:, :, step.start:step.end] = k
            state.values[:, :, step.start:step.end] = v
            k, v = state.keys[:, :, :step.end], state.values[:, :, :step.end]
        if self.stores_kv:
            assert shared_kv is not None, "a layer whose keys are shared needs the SharedKV"
            shared_kv.kv[self.layer_id] = (k, v)
        if step is not None:
            out = attention_ops.masked_attention(q, k, v, step.masks[self.sliding_window],
                                                 scale=self.scale, sinks=self.sinks)
            return self._output(out, gate)
        if mask is None:
            mask = attention_ops.build_mask(None, B, T, x_BTH.device,
                                            sliding_window=self.sliding_window,
                                            sinks=self.sinks is not None)
        out = attention_ops.attention(q, k, v, mask=mask, scale=self.scale, sinks=self.sinks)
        return self._output(out, gate)

    def new_state(self, batch: int, capacity: int, *, dtype: torch.dtype,
                  device: torch.device) -> Any:
        """An empty KV cache for this layer (`posttrain.models.kv_cache.AttentionState`); None
        for a layer that reads another layer's keys and values."""
        if self.kv_source is not None:
            return None
        from posttrain.models.kv_cache import AttentionState
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        return AttentionState(torch.zeros(shape, dtype=dtype, device=device),
                              torch.zeros(shape, dtype=dtype, device=device))


class FeedForward(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), the gated unit from `ops.gated` (which keeps
    two of its three tensors for backward)."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        if args.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{args.hidden_act}' is not supported; "
                              f"use one of {sorted(ACTIVATIONS)}")
        self.hidden_act = args.hidden_act
        inter = intermediate_size or args.intermediate_size
        bias = args.mlp_bias
        self.gate = nn.Linear(args.hidden_size, inter, bias=bias)
        self.up = nn.Linear(args.hidden_size, inter, bias=bias)
        self.down = nn.Linear(inter, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated(self.gate(x), self.up(x), self.hidden_act))


def position_ids_from_documents(document_lengths: list[list[int]], seq_len: int,
                                device: torch.device | str | None = None) -> torch.Tensor:
    """[B, T] positions restarting at 0 at every document start of a packed row."""
    rows = []
    for lengths in document_lengths:
        if sum(lengths) != seq_len:
            raise ValueError(f"document lengths {lengths} sum to {sum(lengths)}, but rows have "
                             f"{seq_len} tokens; every token must belong to one document")
        rows.append(torch.cat([torch.arange(n) for n in lengths]) if lengths
                    else torch.zeros(0, dtype=torch.long))
    return torch.stack(rows).to(device)
