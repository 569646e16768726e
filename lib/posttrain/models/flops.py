"""Model FLOPs per token, for MFU: matmuls only, counted 2 * m * n * k.

Per layer and token, forward:

    projections   2 * H * (nh + 2 * nkv) * d  +  2 * nh * d * H          (q, k, v, o; GQA-aware)
    dense MLP     3 * 2 * H * I
    MoE MLP       2 * H * E  +  top_k * 3 * 2 * H * I_moe                (router + active experts)
    attention     2 * 2 * nh * d * c          (QK^T and AV over the c keys the token sees)
    head          2 * H * padded_vocab        (once per token, as the LM head computes it)

Multi-head latent attention (DeepSeek-V3, `models/mla.py`; C = kv_lora_rank, Cq = q_lora_rank,
Dn, Dr, Dv its head dims) projects through its latents and has value heads of another width:

    projections   2 H Cq + 2 Cq nh (Dn + Dr)     (q_a, q_b; or 2 H nh (Dn + Dr) for a plain q)
                  + 2 H (C + Dr) + 2 C nh (Dn + Dv) + 2 nh Dv H          (kv_a, kv_b, o)
    attention     2 nh (Dn + Dr) c + 2 nh Dv c   (QK^T over Dn + Dr dims, AV over Dv)

Its MoE layers count the router and top_k routed experts as above plus the shared experts, one
dense MLP of n_shared * I_moe. With LoRA, MLA's stages count as one chain as elsewhere, which
is exact when the first adapters sit on the up-projections (q_b, kv_b) or after them; adapters
on q_a or q (not kv_a) as the very first ones would count kv_b's input gradient too, which
autograd skips.

Qwen3.5's attention layers project q to twice its width (query and output gate per head); its
shared expert adds a dense MLP of its width (+ a [1, H] gate). A gated-DeltaNet layer
(`models/deltanet.py`) has the projections q, k (H -> Hk Dk), v, z (H -> Hv Dv), b, a (H -> Hv)
and o, and in place of attention the chunked delta rule (`ops/delta_rule.py`), counted from its
matmuls per value head and chunk of c tokens of one document (`delta_rule_flops`):

    forward   4 c^2 Dk + 2 c^2 Dv        (A = beta K K^T, Q K^T, and the intra-chunk read)
              + c (c - 1) (Dk + Dv)      (two unit-triangular solves, (I + A)^-1 [beta V, W])
              + 2 c Dk Dv                (the state write K^T V'; none after a document's last
                                          chunk, whose state nothing reads)
              + 4 c Dk Dv                (the state reads W S, Q S; none in a document's first
                                          chunk, whose state is zero)
    backward  twice each matmul, and per solve one solve and one [c, D] x [D, c] product

With LoRA, the first adapted layer's delta rule is counted with its whole backward, which it
runs when its q, k and v all carry gradients (adapters on all three, as usual); with adapters on
only some of them it runs part of it.

What the kernel spends on its layout is not model work and is not counted: a document's last
chunk filled up to C tokens, rows filled to a common width, and, where a document starts
inside a packed row, the write before and the reads after the state is zeroed.
Nor is the scan by which the kernel passes the state between chunks (more than two per row):
it forms each chunk's [Dk, Dk] state map and composes them, about 2 Dk^2 (c + Dk + 2 Dv) FLOPs
per chunk forward beyond the counts above, which describe the chunk-by-chunk loop the scan
replaces (the model's work; the scan is there for fewer, larger kernels). For Qwen3.5-0.8B at
8k tokens that is ~4.5% on top of a training step's model FLOPs, counting the forward, its
activation-checkpoint recompute and a backward of twice the forward.

Gemma 4 (`models/gemma4.py`): each layer's attention at its own head width (full layers have
their own, and their own kv heads); no v projection on full layers with k_eq_v, no k or v on
the layers that reuse earlier keys and values; the dense MLP at the layer's width (double on
those layers with `double_wide_mlp`) and, beside it, the MoE block (router + active experts);
per-layer inputs add one projection H -> L P per token before the first layer and, per layer,
a gate H -> P and a projection P -> H. An adapter on the model-level projection makes the
per-layer inputs carry a gradient: each layer's P -> H projection then needs its input
gradient, and the residual stream carries one from the first layer's on.

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
the score recomputation of memory-efficient kernels (hardware FLOPs, not model FLOPs). MLA's
query and key/value paths are separate branches up to the attention: in the first adapted layer,
a branch with an adapter needs its input gradients and the other does not, and the attention's
backward is then dP and dQ (a trained query branch) or dP, dK and dV (a trained key/value one).

LoRA targets follow `posttrain.models.lora.target_of`: a target names an `nn.Linear` by its last
path component or a dotted suffix (`q`, `attn.q`, `router`), the stacked MoE expert weights with
their `experts.` part (`experts.gate`); an expert adapter runs over the routed rows only, top_k
per token, like its expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.models.args import ModelArgs
from posttrain.models.lora import target_of

__all__ = ["attention_context_sum", "delta_rule_flops", "flops_breakdown", "flops_per_token"]


@dataclass(frozen=True)
class _Linear:
    path: str           # module path inside layers[i]
    d_in: int
    d_out: int
    uses: float = 1.0   # applications per token (top_k for experts)
    stacked: bool = False   # MoE expert weights (targeted as `experts.gate`)
    reads_ple: bool = False     # its input also carries the per-layer inputs (Gemma 4)
    branch: str | None = None   # MLA: "q" or "kv", the path (up to the attention) it lies on


_ATTENTION = "attention"   # the stage of the score / value matmuls
_DELTA_RULE = "delta_rule"  # the stage of a gated-DeltaNet layer's recurrence


def _mla_stages(args: ModelArgs) -> list[list[_Linear] | str]:
    """Multi-head latent attention (`models/mla.py`): the latent projections read x, the
    up-projections the normed latents (one stage: q_b's and kv_b's inputs come from parallel
    branches, so an adapter on one does not give the other an input gradient: each linear
    carries its `branch`), attention, the output projection."""
    H, nh, mla = args.hidden_size, args.num_heads, args.latent_attention
    assert mla is not None
    kv_b = _Linear("attn.kv_b", mla.kv_lora_rank, nh * (mla.qk_nope_head_dim + mla.v_head_dim),
                   branch="kv")
    first = [_Linear("attn.kv_a", H, mla.kv_lora_rank + mla.qk_rope_head_dim, branch="kv")]
    if mla.q_lora_rank is None:
        first.insert(0, _Linear("attn.q", H, nh * mla.qk_head_dim, branch="q"))
        ups = [kv_b]
    else:
        first.insert(0, _Linear("attn.q_a", H, mla.q_lora_rank, branch="q"))
        ups = [_Linear("attn.q_b", mla.q_lora_rank, nh * mla.qk_head_dim, branch="q"), kv_b]
    return [first, ups, _ATTENTION, [_Linear("attn.o", nh * mla.v_head_dim, H)]]


def _attention_head_dims(args: ModelArgs, layer: int) -> tuple[int, int]:
    """(query / key, value) head dims of layer `layer`'s attention scores and reads."""
    mla = args.latent_attention
    if mla is not None:
        return mla.qk_head_dim, mla.v_head_dim
    d = args.attention_shape(layer)[1]
    return d, d


def _stages(args: ModelArgs, layer: int) -> list[list[_Linear] | str]:
    """The matmuls of one block in execution order; a stage's linears read the same input."""
    H = args.hidden_size
    kv_heads, d = args.attention_shape(layer)
    q_out, kv_out = args.num_heads * d, kv_heads * d
    la = args.linear_attention
    stages: list[list[_Linear] | str]
    if args.latent_attention is not None:
        stages = _mla_stages(args)
    elif args.is_linear_layer(layer):
        assert la is not None
        stages = [
            [_Linear("attn.q", H, la.key_dim), _Linear("attn.k", H, la.key_dim),
             _Linear("attn.v", H, la.value_dim), _Linear("attn.z", H, la.value_dim),
             _Linear("attn.b", H, la.num_v_heads), _Linear("attn.a", H, la.num_v_heads)],
            _DELTA_RULE,
            [_Linear("attn.o", la.value_dim, H)],
        ]
    else:
        gated_q = q_out * (2 if args.attn_output_gate else 1)
        qkv = [_Linear("attn.q", H, gated_q)]
        if args.kv_source(layer) is None:       # layers reusing others' keys project none
            qkv.append(_Linear("attn.k", H, kv_out))
            if not args.k_eq_v(layer):
                qkv.append(_Linear("attn.v", H, kv_out))
        stages = [qkv, _ATTENTION, [_Linear("attn.o", q_out, H)]]
    if args.gemma4 is not None:
        return stages + _gemma4_mlp_stages(args, layer)
    if args.is_moe_layer(layer):
        k, inter = args.num_experts_per_tok, args.moe_intermediate_size
        shared_in: list[_Linear] = []
        shared_out: list[_Linear] = []
        if args.shared_expert_intermediate_size:
            s_inter = args.shared_expert_intermediate_size
            shared_in = [_Linear("mlp.shared.gate", H, s_inter), _Linear("mlp.shared.up", H, s_inter)]
            shared_in += [_Linear("mlp.shared_gate", H, 1)] if args.shared_expert_gate else []
            shared_out = [_Linear("mlp.shared.down", s_inter, H)]
        stages += [[_Linear("mlp.router", H, args.num_experts),
                    _Linear("mlp.experts.gate", H, inter, k, stacked=True),
                    _Linear("mlp.experts.up", H, inter, k, stacked=True), *shared_in],
                   [_Linear("mlp.experts.down", inter, H, k, stacked=True), *shared_out]]
    else:
        inter = args.intermediate_size
        stages += [[_Linear("mlp.gate", H, inter), _Linear("mlp.up", H, inter)],
                   [_Linear("mlp.down", inter, H)]]
    return stages


def _gemma4_mlp_stages(args: ModelArgs, layer: int) -> list[list[_Linear] | str]:
    """Gemma 4 after attention: the dense MLP with the MoE block beside it, then the gate and
    projection of the per-layer input."""
    g, H, inter = args.gemma4, args.hidden_size, args.mlp_size(layer)
    assert g is not None
    up = [_Linear("mlp.gate", H, inter), _Linear("mlp.up", H, inter)]
    down = [_Linear("mlp.down", inter, H)]
    if args.num_experts:
        k, moe = args.num_experts_per_tok, args.moe_intermediate_size
        up += [_Linear("moe.router", H, args.num_experts),
               _Linear("moe.experts.gate", H, moe, k, stacked=True),
               _Linear("moe.experts.up", H, moe, k, stacked=True)]
        down += [_Linear("moe.experts.down", moe, H, k, stacked=True)]
    stages: list[list[_Linear] | str] = [up, down]
    if g.per_layer_input_size:
        P = g.per_layer_input_size
        stages += [[_Linear("per_layer_gate", H, P)],
                   [_Linear("per_layer_proj", P, H, reads_ple=True)]]
    return stages


def _model_stages(args: ModelArgs) -> list[_Linear]:
    """Matmuls before the first block (paths in the model): Gemma 4's per-layer input
    projection."""
    g = args.gemma4
    if g is None or not g.per_layer_input_size:
        return []
    return [_Linear("per_layer_inputs.proj", args.hidden_size,
                    args.num_layers * g.per_layer_input_size)]


def delta_rule_flops(lengths: list[int], chunk_size: int, num_v_heads: int, head_k_dim: int,
                     head_v_dim: int, *, backward: bool = False) -> float:
    """Matmul FLOPs of the chunked gated delta rule over documents of these lengths (forward,
    or with `backward` forward + backward); see the module docstring."""
    Dk, Dv = head_k_dim, head_v_dim
    total = 0.0
    for length in lengths:
        sizes = [chunk_size] * (length // chunk_size) + ([length % chunk_size]
                                                         if length % chunk_size else [])
        for j, c in enumerate(sizes):
            writes = 2 * c * Dk * Dv if j < len(sizes) - 1 else 0
            reads = 4 * c * Dk * Dv if j else 0
            mm = 4 * c * c * Dk + 2 * c * c * Dv + writes + reads
            solves = c * (c - 1) * (Dk + Dv)
            total += mm + solves
            if backward:
                total += 2 * mm + solves + 2 * c * c * (Dk + Dv)
    return float(num_v_heads * total)


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
             for stage in _stages(args, i) if not isinstance(stage, str) for lin in stage]
    paths += [(lin.path, False) for lin in _model_stages(args)]
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
    # do Gemma 4's per-layer inputs carry one (an adapter on their projection)?
    ple_flowing = _add_linears(out, "", _model_stages(args), flowing, training=training,
                               lora_rank=lora_rank, lora_targets=lora_targets)
    for i in range(args.num_layers):
        window = args.sliding_window if args.is_sliding_layer(i) else None
        context = sum(attention_context_sum(n, window) for n in lengths) / seq_len
        branch_adapted: dict[str, bool] = {}       # MLA: an adapter on the branch so far
        for stage in _stages(args, i):
            if stage == _ATTENTION:
                qk_dim, v_dim = _attention_head_dims(args, i)
                out["attention"] += args.num_heads * context * _attention_per_pair(
                    qk_dim, v_dim, training=training,
                    q_grad=flowing or branch_adapted.get("q", False),
                    kv_grad=flowing or branch_adapted.get("kv", False))
                flowing = flowing or any(branch_adapted.values())
                continue
            if stage == _DELTA_RULE:
                la = args.linear_attention
                out["attention"] += delta_rule_flops(
                    lengths, la.chunk_size, la.num_v_heads, la.head_k_dim, la.head_v_dim,
                    backward=training and flowing) / seq_len
                continue
            flowing = flowing or (ple_flowing and any(lin.reads_ple for lin in stage))
            adapted = _add_linears(out, f"layers.{i}.", stage, flowing, training=training,
                                   lora_rank=lora_rank, lora_targets=lora_targets,
                                   branch_adapted=branch_adapted)
            flowing = flowing or adapted
    if include_head:
        fwd = 2.0 * args.hidden_size * args.padded_vocab_size
        out["head"] = fwd + ((fwd * flowing + fwd * (not lora)) if training else 0.0)
    return out


def _attention_per_pair(qk_dim: int, v_dim: int, *, training: bool, q_grad: bool,
                        kv_grad: bool) -> float:
    """Score and value matmul FLOPs per (query, key) pair and head: forward QK^T (2 qk_dim)
    and PV (2 v_dim); backward dP (2 v_dim) when queries or keys need gradients, then dQ
    (2 qk_dim) for queries, dK (2 qk_dim) and dV (2 v_dim) for keys and values (only one of
    them in MLA's first adapted layer when one branch carries the adapters)."""
    total = 2.0 * qk_dim + 2.0 * v_dim
    if training and (q_grad or kv_grad):
        total += 2.0 * v_dim + 2.0 * qk_dim * q_grad + (2.0 * qk_dim + 2.0 * v_dim) * kv_grad
    return total


def _add_linears(out: dict[str, float], prefix: str, stage: list[_Linear], flowing: bool, *,
                 training: bool, lora_rank: int, lora_targets: tuple[str, ...],
                 branch_adapted: dict[str, bool] | None = None) -> bool:
    """Add one stage's matmuls (and adapters) to `out`; whether an adapter was among them.
    `flowing`: whether the stage's input carries a gradient. A linear on an MLA branch reads
    the branch's input, which carries one also after an adapter earlier on the branch
    (`branch_adapted`, updated here; such adapters are not in the return value, the branch
    joins the residual stream only after the attention)."""
    lora, adapted = lora_rank > 0, False
    branches = {} if branch_adapted is None else branch_adapted
    for lin in stage:
        needs = flowing or (lin.branch is not None and branches.get(lin.branch, False))
        fwd = 2.0 * lin.d_in * lin.d_out * lin.uses
        bwd = (fwd * needs + fwd * (not lora)) if training else 0.0
        out["linear"] += fwd + bwd
        if lora and target_of(prefix + lin.path, lora_targets, stacked=lin.stacked):
            if lin.branch is None:
                adapted = True
            else:
                branches[lin.branch] = True
            a_fwd = 2.0 * lin.d_in * lora_rank * lin.uses
            b_fwd = 2.0 * lora_rank * lin.d_out * lin.uses
            # weight gradients of A and B, input gradient of B, of A only if needed
            a_bwd = b_bwd = 0.0
            if training:
                a_bwd, b_bwd = a_fwd * (1 + needs), 2 * b_fwd
            out["lora"] += a_fwd + b_fwd + a_bwd + b_bwd
    return adapted


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
