"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5's "linear_attention" layers.

Module (`layers[i].attn` on those layers; names are the contract for LoRA, TP and the bridge):

    q, k        nn.Linear [Hk * Dk, hidden]     queries and keys (HF: in_proj_qkv, first parts)
    v           nn.Linear [Hv * Dv, hidden]     values           (HF: in_proj_qkv, last part)
    z           nn.Linear [Hv * Dv, hidden]     output gate      (HF: in_proj_z)
    b, a        nn.Linear [Hv, hidden]          write strength, decay input (HF: in_proj_b/_a)
    conv_q, conv_k, conv_v   Parameter [channels, K]   depthwise causal conv (HF: conv1d, split)
    A_log, dt_bias           Parameter [Hv]     decay rate and its bias
    norm        GatedRMSNorm [Dv]               per-head norm, gated by silu(z)
    o           nn.Linear [hidden, Hv * Dv]     (HF: out_proj)

Per token x (one document; the recurrence restarts at every document of a packed row):

    q, k, v = silu(conv(q(x))), silu(conv(k(x))), silu(conv(v(x)))     causal, width K
    beta    = sigmoid(b(x));   g = -exp(A_log) * softplus(a(x) + dt_bias)
    o_t     = gated delta rule (`posttrain.ops.delta_rule`)
    out     = o(norm(o_t) * silu(z(x)))

HF stores q, k, v as one `in_proj_qkv` and one `conv1d` over their concatenated channels; the
bridge splits them, so that tensor parallelism can give every rank its own heads of each
(column-wise q/k/v/z/b/a, row-wise o, the conv channels and per-head A_log / dt_bias sharded
with them) and LoRA can target q, k, v like attention's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.layers import RMSNorm, position_ids_from_documents
from posttrain.ops.compiler import outside_graphs
from posttrain.ops.delta_rule import (causal_conv, gated_delta_rule,
                                      recurrent_gated_delta_rule)
from posttrain.ops.gated import ACTIVATIONS

__all__ = ["DeltaNetState", "GatedDeltaNet", "GatedRMSNorm"]


class GatedRMSNorm(RMSNorm):
    """`weight * norm(x)` (in x's dtype) times silu(gate) computed in fp32, as Qwen3.5's
    `RMSNormGated` does (norm before gate)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * F.silu(gate.float())).type_as(x)


@dataclass
class DeltaNetState:
    """Decode state of one DeltaNet layer: the last K-1 convolution inputs [B, C, K-1] (q, k, v
    channels concatenated) and the recurrent state [B, Hv, Dk, Dv] (fp32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def select(self, rows_B: torch.Tensor) -> "DeltaNetState":
        return DeltaNetState(self.conv.index_select(0, rows_B),
                             self.recurrent.index_select(0, rows_B))


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard under tensor parallelism (its heads), else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def _positions(lengths: list[list[int]] | None, batch: int, seq_len: int,
               device: torch.device) -> torch.Tensor:
    if lengths is None:
        return torch.arange(seq_len, device=device).expand(batch, seq_len)
    return position_ids_from_documents(lengths, seq_len, device)


class GatedDeltaNet(nn.Module):
    """The gated-DeltaNet token mixer (see the module docstring)."""

    # tensor parallelism by heads (`posttrain.distributed.tensor_parallel.tp_plan`): key heads and
    # their value heads stay together, since both are split into contiguous equal parts
    tp_colwise = ("q", "k", "v", "z", "b", "a")
    tp_rowwise = ("o",)
    tp_head_modules = ("norm",)
    tp_head_params = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")
    tp_head_counts = ("num_k_heads", "num_v_heads")

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        la = args.linear_attention
        if la is None:
            raise ConfigError(f"layer {layer_id} is a linear-attention layer, but the model args "
                              "have no linear_attention settings")
        if args.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{args.hidden_act}' is not supported; "
                              f"use one of {sorted(ACTIVATIONS)}")
        hidden = args.hidden_size
        self.num_k_heads, self.num_v_heads = la.num_k_heads, la.num_v_heads
        self.head_k_dim, self.head_v_dim = la.head_k_dim, la.head_v_dim
        self.chunk_size, self.kernel = la.chunk_size, la.conv_kernel
        self.act = ACTIVATIONS[args.hidden_act]
        self.q = nn.Linear(hidden, la.key_dim, bias=False)
        self.k = nn.Linear(hidden, la.key_dim, bias=False)
        self.v = nn.Linear(hidden, la.value_dim, bias=False)
        self.z = nn.Linear(hidden, la.value_dim, bias=False)
        self.b = nn.Linear(hidden, la.num_v_heads, bias=False)
        self.a = nn.Linear(hidden, la.num_v_heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(la.key_dim, la.conv_kernel))
        self.conv_k = nn.Parameter(torch.empty(la.key_dim, la.conv_kernel))
        self.conv_v = nn.Parameter(torch.empty(la.value_dim, la.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads))
        self.norm = GatedRMSNorm(la.head_v_dim, args.rms_norm_eps)
        self.o = nn.Linear(la.value_dim, hidden, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Conv weights normal(0, 1 / sqrt(K)); decay rates A uniform in [0.01, 16] and
        dt_bias 1, as transformers initialises them. The Linears and the norm initialise
        themselves."""
        for p in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.normal_(p, std=self.kernel ** -0.5)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16.0).log())
        nn.init.ones_(self.dt_bias)

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b(x)) and the log decay g = -exp(A_log) softplus(a(x) + dt_bias)."""
        beta = torch.sigmoid(self.b(x))
        g = -_local(self.A_log).float().exp() * F.softplus(self.a(x).float()
                                                           + _local(self.dt_bias))
        return beta, g

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = q.shape
        return (q.view(B, T, -1, self.head_k_dim), k.view(B, T, -1, self.head_k_dim),
                v.view(B, T, -1, self.head_v_dim))

    def _output(self, core_BTHD: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        z = self.z(x).view(B, T, -1, self.head_v_dim)
        return self.o(self.norm(core_BTHD, z).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, rope: Any = None, mask: Any = None, *,
                state: DeltaNetState | None = None, step: Any = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. `mask`: the batch's `split` DocumentMask (its
        `lengths`; None or lengths None: one document per row). `rope` is not used.
        `state` / `step` (`posttrain.models.kv_cache`): run incrementally."""
        if state is not None:
            return self._forward_cached(x, state, step)
        beta, g = self._gates(x)
        core = self._mix(self.q(x), self.k(x), self.v(x), g, beta, mask)
        return self._output(core, x)

    @outside_graphs
    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, mask: Any) -> torch.Tensor:
        """Convolution and delta rule over the batch's documents, outside compiled graphs:
        the chunk layout follows the document lengths (Python lists), which a compiled block
        would otherwise specialise on, recompiling for every new packing."""
        B, T, _ = q.shape
        lengths = getattr(mask, "lengths", None)
        pos = _positions(lengths, B, T, q.device)
        q, k, v = (self.act(causal_conv(t, _local(w), pos))
                   for t, w in ((q, self.conv_q), (k, self.conv_k), (v, self.conv_v)))
        core, _ = gated_delta_rule(*self._heads(q, k, v), g, beta, document_lengths=lengths,
                                   chunk_size=self.chunk_size)
        return core

    def _forward_cached(self, x: torch.Tensor, state: DeltaNetState, step: Any) -> torch.Tensor:
        """Prefill (from slot 0: the left padding is its own document) with the chunked form,
        or decode steps with the recurrent form; updates `state` in place."""
        B, T, _ = x.shape
        x_in = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)          # [B, T, C]
        weight = torch.cat([_local(self.conv_q), _local(self.conv_k), _local(self.conv_v)])
        split = [self.conv_q.shape[0], self.conv_k.shape[0], self.conv_v.shape[0]]
        beta, g = self._gates(x)
        K = self.kernel
        if step.start == 0:
            lengths = step.document_lengths()
            mixed = self.act(causal_conv(x_in, weight, _positions(lengths, B, T, x.device)))
            core, recurrent = gated_delta_rule(*self._heads(*mixed.split(split, dim=-1)), g,
                                               beta, document_lengths=lengths,
                                               chunk_size=self.chunk_size,
                                               output_final_state=True)
            # the inputs the next tokens' convolution reads: the prompt's own, zeros before it
            slots = torch.arange(T, device=x.device)
            real = (slots[None] >= step.pad_B[:, None])[..., None].to(x_in.dtype)
            history = F.pad(x_in * real, (0, 0, max(K - 1 - T, 0), 0))[:, -(K - 1):]
        else:
            mixed = self.act(causal_conv(x_in, weight, None, history_BCk=state.conv))
            core, recurrent = recurrent_gated_delta_rule(
                *self._heads(*mixed.split(split, dim=-1)), g, beta,
                initial_state=state.recurrent)
            history = torch.cat([state.conv.transpose(1, 2).to(x_in.dtype), x_in],
                                dim=1)[:, -(K - 1):]
        state.conv = history.transpose(1, 2).contiguous()
        state.recurrent = recurrent
        return self._output(core, x)

    def new_state(self, batch: int, capacity: int, *, dtype: torch.dtype,
                  device: torch.device) -> DeltaNetState:
        """Zero conv inputs and recurrent state (the capacity of a KV cache does not matter)."""
        channels = self.conv_q.shape[0] + self.conv_k.shape[0] + self.conv_v.shape[0]
        return DeltaNetState(
            torch.zeros(batch, channels, self.kernel - 1, dtype=dtype, device=device),
            torch.zeros(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                        dtype=torch.float32, device=device))

    def extra_repr(self) -> str:
        return (f"k_heads={self.num_k_heads}x{self.head_k_dim}, "
                f"v_heads={self.num_v_heads}x{self.head_v_dim}, conv_kernel={self.kernel}, "
                f"chunk_size={self.chunk_size}")
