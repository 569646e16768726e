"""MoE routing replay: the trainer routes every token through the experts the rollout engine
chose for it.

Why. An MoE policy's log-probs depend on discrete top-k choices. The engine (KV-cache decode,
other kernels, possibly older weights) and the trainer (one packed forward) compute router
logits that differ in the last bits; where two experts are nearly tied, they choose different
experts, and the token's log-prob jumps. The importance ratio pi_trainer / pi_engine is then
noise that no clipping removes; on large MoE models (Qwen3-30B-A3B) it collapses GRPO runs.
R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers") records the engine's choices and replays them in the trainer's forwards, for the
importance ratio and the update.

Record. The engine reads, after each forward, the experts every MoE block chose
(`recorded_routing`: [N, L, k] int16 over the L MoE blocks in layer order), for every prompt
and completion position it ran; a position it never ran (a completion's last token, which no
later token reads) is recorded as -1.

Replay. `set_routing_replay(model, routing)` gives each block its slice [N, k] of a record
[B, T, L, k] of the input rows; the block (`MoEBlock.replayed`) uses the recorded ids e^rec
in place of its own top-k, and weighs them from its own router logits:

    "softmax_topk" (Qwen3-MoE):   w = softmax(logits)[e^rec], / sum(w) if norm_topk_prob
                                  (x expert_scale: Gemma 4)
    "topk_softmax" (GPT-OSS):     w = softmax(logits[e^rec])
    "sigmoid_group_topk" (DeepSeek-V3): w = sigmoid(logits)[e^rec], / sum(w) if
                                  norm_topk_prob, x routed_scaling_factor (the score-correction
                                  bias and the group limit only choose: e^rec is their choice)

exactly as the block weighs its own choice, so replaying a block's own choice changes no bit;
the selection is the engine's, the weights stay differentiable (the router keeps learning).
A -1 row keeps the block's own routing (padding, unrecorded positions). The record stays set
until the next call: activation-checkpointed blocks recompute the same routing in the backward.

Each block counts the token selections it replayed and those where its own top-k set differs
(`routing_replay_counts`): the train/inference routing mismatch a run logs.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.models.moe import MoEBlock

__all__ = ["moe_blocks", "recorded_routing", "routing_replay_counts", "set_routing_replay"]


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The MoE blocks of `model`, in layer order (the L of a routing record)."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def recorded_routing(blocks: list[MoEBlock]) -> torch.Tensor:
    """The experts the last forward chose, [N, L, k] int16 over `blocks` (`moe_blocks`)."""
    return torch.stack([b.expert_NK for b in blocks], dim=1).to(torch.int16)


def set_routing_replay(model: nn.Module, routing: torch.Tensor | None) -> None:
    """Make `model`'s next forwards replay `routing` [B, T, L, k] (expert ids per token of
    the input rows and MoE block; -1 rows: the block's own routing), or route on their own
    (None). It stays set until the next call, so that activation-checkpointed blocks
    recompute the same routing in the backward."""
    blocks = moe_blocks(model)
    if routing is None:
        for block in blocks:
            block.replay_NK = block.replay_counts = None
        return
    if routing.dim() != 4 or routing.shape[2] != len(blocks):
        raise ValueError(f"routing replay: a record of shape {tuple(routing.shape)} for a model "
                         f"with {len(blocks)} MoE layers; expected [rows, tokens, "
                         f"{len(blocks)}, top_k]")
    top_k, experts = blocks[0].top_k, blocks[0].experts.num_experts
    if routing.shape[3] != top_k or int(routing.max()) >= experts or int(routing.min()) < -1:
        raise ValueError(f"routing replay: recorded expert ids must be in [0, {experts}) "
                         f"(or -1), {top_k} per token; got shape {tuple(routing.shape)}, ids "
                         f"{int(routing.min())}..{int(routing.max())}")
    for i, block in enumerate(blocks):
        block.replay_NK = routing[:, :, i].reshape(-1, top_k)
        block.replay_counts = None


def routing_replay_counts(model: nn.Module) -> torch.Tensor:
    """[2] int64: the token selections the last forward replayed, summed over the MoE blocks,
    and of them those where a block's own top-k set differs from the recorded one."""
    counts = [b.replay_counts for b in moe_blocks(model) if b.replay_counts is not None]
    if not counts:
        return torch.zeros(2, dtype=torch.long)
    return torch.stack(counts).sum(0)
