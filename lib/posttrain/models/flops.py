"""Model FLOPs per token, for MFU: matmuls only, counted 2 * m * n * k.

Per layer and token, forward:

    projections   2 * H * (nh + 2 * nkv) * d  +  2 * nh * d * H          (q, k, v, o; GQA-aware)
    dense MLP     3 * 2 * H * I
    MoE MLP       2 * H * E  +  top_k * 3 * 2 * H * I_moe                (router + active experts)
    attention     2 * 2 * nh * d * c          (QK^T and AV over the c keys the token sees)
    head          2 * H * padded_vocab        (once per token, as the LM head computes it)

c is the causal context: a token at position p (0-based) of its document sees min(p + 1, window)
keys, so a document of L tokens costs sum_p min(p + 1, w) -- L (L + 1) / 2 without a window --
and a packed row sum_i over its documents, not (sum_i L_i)^2. Work a kernel spends on masked-out
scores is not counted (it is not model FLOPs).

Training adds the backward pass. A matmul y = x W^T has two backward matmuls of the forward's
size: the input gradient (needed when anything before it is trained) and the weight gradient
(needed when W is trained). Full fine-tuning therefore costs 3x forward; with LoRA the frozen
base weights cost ~2x (no weight gradient), the adapters (A: in -> r, B: r -> out) their full 3x,
and in the first layer the base matmuls before the first adapter need no backward at all (no
input requires a gradient yet). Attention's backward is 2x its forward (dS, dV, dQ, dK), without
the score recomputation of memory-efficient kernels (hardware FLOPs, not model FLOPs).

LoRA targets follow `posttrain.models.lora.target_of`: a target names an `nn.Linear` by its last
path component or a dotted suffix (`q`, `attn.q`, `router`), the stacked MoE expert weights with
their `experts.` part (`experts.gate`); an expert adapter runs over the routed rows only, top_k
per token, like its expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.models.args import ModelArgs
from posttrain.models.lora import target_of

__all__ = ["attention_context_sum", "flops_breakdown", "flops_per_token"]


@dataclass(frozen=True)
class _Linear:
    path: str           # module path inside layers[i]
    d_in: int
    d_out: int
    uses: float = 1.0   # applications per token (top_k for experts)
    stacked: bool = False   # MoE expert weights (targeted as `experts.gate`)


_ATTENTION = "attention"   # the stage of the score / value matmuls


def _stages(args: ModelArgs, layer: int) -> list[list[_Linear] | str]:
    """The matmuls of one block in execution order; a stage's linears read the same input."""
    H, d = args.hidden_size, args.head_dim
    q_out, kv_out = args.num_heads * d, args.num_kv_heads * d
    stages: list[list[_Linear] | str] = [
        [_Linear("attn.q", H, q_out), _Linear("attn.k", H, kv_out), _Linear("attn.v", H, kv_out)],
        _ATTENTION,
        [_Linear("attn.o", q_out, H)],
    ]
    if args.is_moe_layer(layer):
        k, inter = args.num_experts_per_tok, args.moe_intermediate_size
        stages += [[_Linear("mlp.router", H, args.num_experts),
                    _Linear("mlp.experts.gate", H, inter, k, stacked=True),
                    _Linear("mlp.experts.up", H, inter, k, stacked=True)],
                   [_Linear("mlp.experts.down", inter, H, k, stacked=True)]]
    else:
        inter = args.intermediate_size
        stages += [[_Linear("mlp.gate", H, inter), _Linear("mlp.up", H, inter)],
                   [_Linear("mlp.down", inter, H)]]
    return stages


def attention_context_sum(length: int, window: int | None = None) -> int:
    """sum over the positions of one causal document of the keys each sees: sum_p min(p+1, w)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def flops_breakdown(args: ModelArgs, seq_len: int, *, training: bool = True,
                    lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
                    document_lengths: list[int] | None = None,
                    include_head: bool = True) -> dict[str, float]:
    """`flops_per_token` split into "linear" (frozen or trained base projections and MLPs),
    "attention" (QK^T and AV), "head" and "lora" (adapter matmuls); FLOPs per token."""
    lengths = list(document_lengths) if document_lengths is not None else [seq_len]
    if sum(lengths) != seq_len or any(n <= 0 for n in lengths):
        raise ValueError(f"document_lengths {lengths} must be positive and sum to seq_len="
                         f"{seq_len}")
    if (lora_rank > 0) != bool(lora_targets):
        raise ValueError(f"lora_rank={lora_rank} and lora_targets={lora_targets}: give both "
                         "(LoRA) or neither (full fine-tuning)")
    lora = lora_rank > 0
    paths = [(f"layers.{i}.{lin.path}", lin.stacked) for i in range(args.num_layers)
             for stage in _stages(args, i) if stage != _ATTENTION for lin in stage]
    unknown = [t for t in lora_targets
               if not any(target_of(p, (t,), stacked=stacked) for p, stacked in paths)]
    if unknown:
        raise ValueError(f"lora_targets {unknown} match no linear layer of this {args.family} "
                         "model; use names such as 'q', 'attn.o', 'gate', 'router', or "
                         "'experts.gate' for MoE expert weights")

    out = {"linear": 0.0, "attention": 0.0, "head": 0.0, "lora": 0.0}
    # does the activation entering the current matmul carry a gradient? With full fine-tuning
    # the embedding is trained, so from the start; with LoRA, from the first adapter on.
    flowing = not lora
    for i in range(args.num_layers):
        window = args.sliding_window if args.is_sliding_layer(i) else None
        context = sum(attention_context_sum(n, window) for n in lengths) / seq_len
        for stage in _stages(args, i):
            if stage == _ATTENTION:
                fwd = 4.0 * args.num_heads * args.head_dim * context
                out["attention"] += fwd * (1 + (2 if training and flowing else 0))
                continue
            adapted = False
            for lin in stage:
                fwd = 2.0 * lin.d_in * lin.d_out * lin.uses
                bwd = (fwd * flowing + fwd * (not lora)) if training else 0.0
                out["linear"] += fwd + bwd
                if lora and target_of(f"layers.{i}.{lin.path}", lora_targets,
                                      stacked=lin.stacked):
                    adapted = True
                    a_fwd = 2.0 * lin.d_in * lora_rank * lin.uses
                    b_fwd = 2.0 * lora_rank * lin.d_out * lin.uses
                    # weight gradients of A and B, input gradient of B, of A only if needed
                    a_bwd = b_bwd = 0.0
                    if training:
                        a_bwd, b_bwd = a_fwd * (1 + flowing), 2 * b_fwd
                    out["lora"] += a_fwd + b_fwd + a_bwd + b_bwd
            flowing = flowing or adapted
    if include_head:
        fwd = 2.0 * args.hidden_size * args.padded_vocab_size
        out["head"] = fwd + ((fwd * flowing + fwd * (not lora)) if training else 0.0)
    return out


def flops_per_token(args: ModelArgs, seq_len: int, *, training: bool = True,
                    lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
                    document_lengths: list[int] | None = None,
                    include_head: bool = True) -> float:
    """Matmul FLOPs per token of a row of `seq_len` tokens (see the module docstring).

    `training`: forward + backward (else forward only). `lora_rank` / `lora_targets`: the base
    weights are frozen and adapters of that rank sit on the targeted linears
    (`posttrain.models.lora.flops_kwargs(cfg)` gives both). `document_lengths`: the documents
    packed into the row (summing to seq_len; default one document). `include_head`: count the
    LM head (off where the loss head is accounted separately).
    """
    return sum(flops_breakdown(args, seq_len, training=training, lora_rank=lora_rank,
                               lora_targets=tuple(lora_targets),
                               document_lengths=document_lengths,
                               include_head=include_head).values())
