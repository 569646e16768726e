"""flops_per_token against torch's FlopCounterMode on a forward + backward of the native model.

How the comparison is made meaningful:

- On the CPU, FlopCounterMode has no formula for the SDPA kernel torch runs there
  (`_scaled_dot_product_flash_attention_for_cpu`), so attention would count 0. The test registers
  torch's own GPU SDPA formulas for it (`custom_mapping`): every SDPA call then counts its full
  [Lq, Lk] score square (forward 2 matmuls, backward 5 incl. the score recomputation).
- flops_per_token counts model FLOPs: only the (query, key) pairs the mask allows, and a backward
  of 4 matmuls. The SDPA counts are therefore scaled by (allowed pairs / counted square pairs),
  with the allowed pairs taken from the attention op's own mask builder, and the backward by 4/5.
- Everything else (projections, MLPs, router, the experts that were actually routed to, head,
  LoRA adapters, the backward matmuls autograd skips for frozen weights) is counted by
  FlopCounterMode as executed and compared unchanged. MoE routing needs no adjustment: every
  token runs exactly top_k experts whatever the router chooses.
- Qwen3.5's gated-DeltaNet layers run the chunked delta rule: its matmuls are counted as
  executed; FlopCounterMode has no formula for the unit-triangular solves, so the test gives it
  one (c (c - 1) D per [c, c] system and D right-hand sides). The rule passes its state from
  chunk to chunk in the serial loop here, the form model FLOPs describe: the scan it runs over
  more chunks adds matmuls (its state maps) that are hardware work, not model work (see
  flops.py), as a flash kernel's score recomputation is. The documents are whole chunks
  (no padding); a document that starts inside a row reads the zeroed state once, which the
  kernel executes but model FLOPs do not count: that read is subtracted.
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from posttrain.models import ModelArgs, args_from_hf_config, build_model
from posttrain.models.flops import (attention_context_sum, delta_rule_flops, flops_breakdown,
                                    flops_per_token)
from posttrain.models.verify import tiny_hf_config
from posttrain.ops import delta_rule
from posttrain.ops.attention import _causal_window_mask

aten = torch.ops.aten
SDPA_FWD = aten._scaled_dot_product_flash_attention_for_cpu
SDPA_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward
FAMILIES = ("qwen3", "llama", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma4",
            "deepseek_v3")
SEQ_LEN, BATCH = 32, 2
DOCS = [20, 12]      # both rows; longer than gemma3's window of 8 and one shorter than the other


def _sdpa_fwd(calls: list[int]):
    def count(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        calls.append(sdpa_flop_count(query_shape, key_shape, value_shape))
        return calls[-1]
    return count


def _sdpa_bwd(calls: list[int]):
    def count(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
              **kwargs) -> int:
        calls.append(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                              value_shape))
        return calls[-1]
    return count


def _args(family: str) -> ModelArgs:
    args = args_from_hf_config(tiny_hf_config(family).to_dict())
    if args.linear_attention is not None:     # chunks of 4: DOCS and SEQ_LEN are whole chunks
        args = args.replace(linear_attention=dataclasses.replace(args.linear_attention,
                                                                 chunk_size=4))
    return args


def _layout_work(args: ModelArgs, docs: list[int] | None) -> float:
    """Per token: what the chunked delta rule executes for its layout but model FLOPs do not
    count. With documents of whole chunks, a packed row runs exactly what one document of the
    row's length would (the state is zeroed, not skipped, at each document start). Every
    linear-attention layer here has a backward (full fine-tuning, or an adapter before it)."""
    la = args.linear_attention
    if la is None or docs is None:
        return 0.0
    def rule(lengths: list[int]) -> float:
        return delta_rule_flops(lengths, la.chunk_size, la.num_v_heads, la.head_k_dim,
                                la.head_v_dim, backward=True)
    linear_layers = sum(args.is_linear_layer(i) for i in range(args.num_layers))
    return linear_layers * (rule([SEQ_LEN]) - rule(docs)) / SEQ_LEN


def _allowed_fraction(args: ModelArgs, layer: int, docs: list[int]) -> float:
    """Allowed (query, key) pairs / the squares SDPA computes, per document, from the op's mask."""
    window = args.sliding_window if args.is_sliding_layer(layer) else None
    allowed = sum(int(_causal_window_mask(n, window, "cpu").sum()) for n in docs)
    return allowed / sum(n * n for n in docs)


def _solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A unit-lower-triangular [c, c] system with D right-hand sides: c (c - 1) D FLOPs."""
    *batch, c, d = b_shape
    return math.prod(batch) * c * (c - 1) * d


def _counted_flops(model, args: ModelArgs, docs: list[int] | None) -> tuple[float, dict]:
    """Model FLOPs of one forward + backward, per token, as executed (attention adjusted)."""
    ids = torch.randint(0, args.vocab_size, (BATCH, SEQ_LEN),
                        generator=torch.Generator().manual_seed(0))
    rows = [docs] * BATCH if docs is not None else None
    from posttrain.models.moe import grouped_mm_available, grouped_mm_flops
    grouped_mm_available(ids.device, torch.float32)     # its one-time probe is not the model's
    fwd_calls: list[int] = []
    bwd_calls: list[int] = []
    serial = mock.patch.object(delta_rule, "_SERIAL_MAX_CHUNKS", 10 ** 9)   # see the docstring
    with serial, FlopCounterMode(display=False, custom_mapping={
            SDPA_FWD: _sdpa_fwd(fwd_calls), SDPA_BWD: _sdpa_bwd(bwd_calls),
            aten._grouped_mm: grouped_mm_flops,          # the grouped MoE experts
            aten.linalg_solve_triangular: _solve_triangular}) as counter:
        model.logits(model(ids, document_lengths=rows)).float().sum().backward()
    by_op = counter.get_flop_counts()["Global"]
    fwd_sq, bwd_sq = by_op.get(SDPA_FWD, 0), by_op.get(SDPA_BWD, 0)
    if args.latent_attention is not None:
        # MLA's values are narrower than its queries and keys, which the CPU's flash kernel
        # cannot take: SDPA runs its math kernel, whose only batched matmuls are the score and
        # value matmuls over full squares, backward twice forward as counted by flops.py; every
        # MLA layer is full causal attention, so one fraction scales them all
        squares = by_op.get(aten.bmm, 0)
        assert squares > 0 and fwd_sq == 0, f"attention was not counted: {dict(by_op)}"
        attention = squares * _allowed_fraction(args, 0, docs or [SEQ_LEN])
        total = counter.get_total_flops() - squares + attention
        return total / (BATCH * SEQ_LEN), {"attention": attention / (BATCH * SEQ_LEN)}
    assert fwd_sq > 0 and bwd_sq > 0, f"SDPA was not counted: {dict(by_op)}"
    # every attention layer makes the same number of SDPA calls (one per document), in layer
    # order forward and in reverse order backward, where only the layers from the first one
    # that carries a gradient on run one; each layer's calls are scaled by its own fraction
    # (windows and, on Gemma 4, head dims differ by layer kind; linear-attention layers run no
    # SDPA)
    layers = [i for i in range(args.num_layers) if not args.is_linear_layer(i)]
    per_layer = len(fwd_calls) // len(layers)
    assert per_layer * len(layers) == len(fwd_calls) and len(bwd_calls) % per_layer == 0

    def scaled(calls: list[int], order: list[int]) -> float:
        return sum(sum(calls[j * per_layer:(j + 1) * per_layer])
                   * _allowed_fraction(args, layer, docs or [SEQ_LEN])
                   for j, layer in enumerate(order[:len(calls) // per_layer]))

    attention = scaled(fwd_calls, layers) + scaled(bwd_calls, layers[::-1]) * 4 / 5
    total = counter.get_total_flops() - fwd_sq - bwd_sq + attention
    return total / (BATCH * SEQ_LEN), {"attention": attention / (BATCH * SEQ_LEN)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_full_finetune_matches_flop_counter(family, packed) -> None:
    args = _args(family)
    model = build_model(args, seed=0)
    docs = DOCS if packed else None
    counted, parts = _counted_flops(model, args, docs)
    counted -= _layout_work(args, docs)
    predicted = flops_per_token(args, SEQ_LEN, document_lengths=docs)
    breakdown = flops_breakdown(args, SEQ_LEN, document_lengths=docs)
    assert abs(predicted - counted) / counted < 0.05, (predicted, counted)
    if args.linear_attention is None:     # the counter cannot tell the delta rule's matmuls apart
        assert abs(breakdown["attention"] - parts["attention"]) / parts["attention"] < 0.05
    # it is in fact exact for these shapes
    assert predicted == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("family,targets", [
    ("qwen3", ("q", "v")),
    ("llama", ("o", "down")),              # first adapter after the attention of layer 0
    ("gemma3", ("q", "k", "v", "o", "gate", "up", "down")),
    ("qwen3_moe", ("q", "router", "gate")),
    ("qwen3_moe", ("o", "experts.gate", "experts.down")),     # stacked expert adapters
    ("qwen3_moe", ("experts.up",)),        # the first adapter inside the first MoE layer
    ("qwen3_5", ("q", "k", "v", "o", "z")),   # DeltaNet and gated attention projections
    # q, k and v together: the first delta rule then runs its whole backward (see flops.py)
    ("qwen3_5_moe", ("q", "k", "v", "experts.gate", "shared_gate")),
    # MLA's up-projections first (q and k then both need gradients in every attention),
    # routed and shared experts
    ("deepseek_v3", ("q_b", "kv_b", "o", "experts.down", "shared.up")),
    ("deepseek_v3", ("q_a", "kv_a", "router", "gate", "experts.gate")),   # the latents, dense MLP
    # layer 0 with adapters on one MLA branch only: the other branch's projections need no
    # input gradient, and the attention's backward only dP, dQ (or dP, dK, dV)
    ("deepseek_v3", ("q_b",)),
    ("deepseek_v3", ("kv_a", "experts.down")),
    # shared-KV and k_eq_v layers, the MoE beside the dense MLP, the per-layer input gates
    ("gemma4", ("q", "k", "v", "o", "down", "experts.up", "router", "per_layer_proj")),
    # only the model-level per-layer input projection: gradients enter through every layer's
    # per-layer input, from the first layer's on
    ("gemma4", ("per_layer_inputs.proj",)),
])
def test_lora_matches_flop_counter(family, targets) -> None:
    from posttrain.models.lora import LoraConfig, apply_lora, flops_kwargs

    args = _args(family)
    model = build_model(args, seed=0)
    cfg = LoraConfig(rank=4, alpha=8, targets=targets, init_seed=0)
    apply_lora(model, cfg)
    with torch.no_grad():                 # B = 0 would hide nothing, but keep it non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    counted, _ = _counted_flops(model, args, DOCS)
    counted -= _layout_work(args, DOCS)
    predicted = flops_per_token(args, SEQ_LEN, document_lengths=DOCS, **flops_kwargs(cfg))
    assert abs(predicted - counted) / counted < 0.05, (predicted, counted)
    assert predicted == pytest.approx(counted, rel=1e-9)
    full = flops_per_token(args, SEQ_LEN, document_lengths=DOCS)
    assert predicted < full                # frozen base weights skip their weight gradients


def test_closed_forms() -> None:
    args = _args("qwen3")
    H, V, d, L = 64, args.padded_vocab_size, 16, 2
    per_layer_linear = 2 * H * (4 + 2 + 2) * d + 2 * 4 * d * H + 3 * 2 * H * 128
    attention = 4 * 4 * d * (SEQ_LEN + 1) / 2
    fwd = L * (per_layer_linear + attention) + 2 * H * V
    assert flops_per_token(args, SEQ_LEN, training=False) == pytest.approx(fwd)
    assert flops_per_token(args, SEQ_LEN) == pytest.approx(3 * fwd)
    assert flops_per_token(args, SEQ_LEN, training=False, include_head=False) \
        == pytest.approx(fwd - 2 * H * V)

    # packing: sum L_i^2, not (sum L_i)^2
    packed = flops_breakdown(args, SEQ_LEN, document_lengths=[16, 16], training=False)
    assert packed["attention"] == pytest.approx(L * 4 * 4 * d * (2 * 16 * 17 / 2) / SEQ_LEN)
    assert attention_context_sum(10) == 55
    assert attention_context_sum(10, window=4) == 10 + 6 * 4
    assert attention_context_sum(3, window=8) == 6


def test_moe_counts_only_active_experts() -> None:
    args = _args("qwen3_moe")                       # 8 experts, top-2, layers 0, 1, 3 MoE
    dense = args.replace(num_experts=0)
    fwd = flops_breakdown(args, SEQ_LEN, training=False)["linear"]
    fwd_dense = flops_breakdown(dense, SEQ_LEN, training=False)["linear"]
    H, I_dense, I_moe = 64, 128, 32
    moe_mlp = 2 * H * 8 + 2 * 3 * 2 * H * I_moe
    assert fwd - fwd_dense == pytest.approx(3 * (moe_mlp - 3 * 2 * H * I_dense))


def test_bad_arguments() -> None:
    args = _args("qwen3")
    with pytest.raises(ValueError, match="sum to seq_len"):
        flops_per_token(args, SEQ_LEN, document_lengths=[10, 10])
    with pytest.raises(ValueError, match="give both"):
        flops_per_token(args, SEQ_LEN, lora_rank=8)
    with pytest.raises(ValueError, match="match no linear"):
        flops_per_token(args, SEQ_LEN, lora_rank=8, lora_targets=("q_proj",))
