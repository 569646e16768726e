"""The router's training terms: the load-balancing loss and z-loss every MoE family may add
(`load_balancing_loss`, `router_z_loss`, `moe_aux_loss`), and the balancing of DeepSeek-V3's
sigmoid routing (`moe.MoEBlock`, "sigmoid_group_topk"; DeepSeek-AI 2024, arXiv:2412.19437
§2.1.2).

Auxiliary-loss-free balancing: after every optimizer step each router's score-correction bias
moves against its experts' load over the step's tokens (`expert_loads` after each forward,
summed over micro-batches and data-parallel ranks, then `update_score_bias`; the engine does
it with `ModelConfig.moe_bias_update_speed` > 0 and reports `max_load_violation`). The bias
only chooses experts, never weighs them, so balancing changes no gradient.

The complementary sequence-wise balance loss (`sequence_balance_loss`) is the router term the
paper adds with a tiny weight; transformers' DeepseekV3ForCausalLM adds none, so the engine
adds it only when `ModelConfig.moe_aux_loss_coef` is set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.models.args import ModelArgs
from posttrain.models.moe import MoEBlock, expert_group, router_logits

__all__ = ["expert_loads", "load_balancing_loss", "max_load_violation", "moe_aux_loss",
           "router_z_loss", "score_bias_blocks", "sequence_balance_loss", "update_score_bias"]


def load_balancing_loss(router_logits_LNE: list[torch.Tensor], top_k: int,
                        token_mask: torch.Tensor | None = None,
                        group: Any = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6), over all layers.

        f_e = (1 / (L * N)) * sum_{l, tokens} [e in top_k(softmax(logits_l))]
        P_e = (1 / (L * N)) * sum_{l, tokens} softmax(logits_l)_e
        loss = E * sum_e f_e * P_e

    Counts and probabilities are pooled over layers before the product, as transformers'
    `load_balancing_loss_func` does. `token_mask` [B, T] (1 = real token) leaves padding out.

    `group` (expert parallelism, `expert_group`): the experts serve the group's tokens, so f_e
    and N are the group's (their sums all-reduced, no gradient), and each rank returns
    G * E * sum_e f_e * P_e^r with P_e^r its own tokens' probability sums over the group's N:
    the mean over the G ranks, which their averaged gradients follow, is the loss of the
    group's tokens pooled.
    """
    num_experts = router_logits_LNE[0].shape[-1]
    device = router_logits_LNE[0].device
    count_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask_N = None if token_mask is None else token_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits_LNE:
        probs = torch.softmax(logits, dim=-1)
        _, expert = torch.topk(probs, top_k, dim=-1)
        weight = (torch.ones_like(expert, dtype=torch.float32) if mask_N is None
                  else mask_N[:, None].expand_as(expert))
        count_E = count_E.scatter_add(0, expert.reshape(-1), weight.reshape(-1))
        probs = probs.float()
        prob_E = prob_E + (probs if mask_N is None else probs * mask_N[:, None]).sum(0)
        rows = rows + (probs.shape[0] if mask_N is None else mask_N.sum())
    if group is None:
        return num_experts * torch.sum((count_E / rows) * (prob_E / rows))
    totals = torch.cat([count_E, rows.reshape(1)]).detach()
    dist.all_reduce(totals, group=group)
    count_E, rows = totals[:-1], totals[-1]
    size = dist.get_world_size(group)
    return size * num_experts * torch.sum((count_E / rows) * (prob_E / rows))


def router_z_loss(router_logits_LNE: list[torch.Tensor],
                  token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE, eq. 5): the mean over layers and tokens of
    logsumexp(logits)^2, which keeps router logits small; `token_mask` leaves padding out."""
    total = torch.zeros((), dtype=torch.float32, device=router_logits_LNE[0].device)
    rows = torch.zeros((), dtype=torch.float32, device=total.device)
    mask_N = None if token_mask is None else token_mask.reshape(-1).to(total.device,
                                                                       torch.float32)
    for logits in router_logits_LNE:
        z_N = torch.logsumexp(logits.float(), dim=-1).square()
        total = total + (z_N.sum() if mask_N is None else (z_N * mask_N).sum())
        rows = rows + (z_N.shape[0] if mask_N is None else mask_N.sum())
    return total / rows


def moe_aux_loss(model: nn.Module, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`router_aux_loss_coef * load_balancing_loss` of the last forward, the term to add to the
    training loss (0 for a model without MoE layers)."""
    logits = router_logits(model)
    args: ModelArgs = model.args
    if not logits:
        return torch.zeros(())
    return args.router_aux_loss_coef * load_balancing_loss(logits, args.num_experts_per_tok,
                                                           token_mask, expert_group(model))


def sequence_balance_loss(router_logits_LNE: list[torch.Tensor], expert_LNK: list[torch.Tensor],
                          document_lengths: list[list[int]],
                          token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv:2412.19437 eqs. 17-20),
    for sigmoid routing, per MoE layer and sequence of T tokens (a document of a packed row):

        s'_t = sigmoid(logits_t) / sum_j sigmoid(logits_t)_j
        f_i  = E / (K T) * sum_t [i among the experts token t was routed to]
        P_i  = 1 / T * sum_t s'_t,i
        loss = sum_i f_i P_i

    averaged over the sequences and the layers. The paper's indicator reads top-K of s; here
    it is the routing itself (bias and group limit included), the load being balanced.
    `document_lengths` [B][docs] are the rows' sequences; `token_mask` [B, T] (1 = real token)
    leaves padding out.
    """
    n = router_logits_LNE[0].shape[0]
    device = router_logits_LNE[0].device
    doc_N = torch.repeat_interleave(torch.arange(sum(len(r) for r in document_lengths)),
                                    torch.tensor([x for r in document_lengths for x in r]))
    doc_N = doc_N.to(device)
    assert doc_N.shape[0] == n, (doc_N.shape, n)
    mask_N = (torch.ones(n, device=device) if token_mask is None
              else token_mask.reshape(-1).to(device, torch.float32))
    docs = int(doc_N.max()) + 1
    tokens_D = torch.zeros(docs, device=device).index_add(0, doc_N, mask_N)
    kept = tokens_D > 0
    total = torch.zeros((), device=device)
    for logits, expert in zip(router_logits_LNE, expert_LNK, strict=True):
        E, K = logits.shape[1], expert.shape[1]
        s = torch.sigmoid(logits.float())
        s = s / s.sum(dim=-1, keepdim=True)
        routed = torch.zeros_like(s).scatter_(1, expert, 1.0)
        f_DE = torch.zeros(docs, E, device=device).index_add(0, doc_N, routed * mask_N[:, None])
        P_DE = torch.zeros(docs, E, device=device).index_add(0, doc_N, s * mask_N[:, None])
        f_DE = f_DE[kept] * E / (K * tokens_D[kept, None])
        P_DE = P_DE[kept] / tokens_D[kept, None]
        total = total + (f_DE * P_DE).sum(-1).mean()
    return total / len(router_logits_LNE)


def score_bias_blocks(model: nn.Module) -> list[MoEBlock]:
    """The MoE blocks whose router has a score-correction bias (DeepSeek-V3), in layer order."""
    return [m for m in model.modules()
            if isinstance(m, MoEBlock) and m.routing == "sigmoid_group_topk"]


def expert_loads(model: nn.Module, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[L, E] float64: how many tokens each `score_bias_blocks` block routed to each expert in
    the last forward (`token_mask` [B, T], 1 = real token, leaves padding out)."""
    rows = []
    for block in score_bias_blocks(model):
        if block.expert_NK is None:
            raise RuntimeError("expert loads are read before any forward pass")
        expert = block.expert_NK
        weight = (torch.ones_like(expert, dtype=torch.float64) if token_mask is None else
                  token_mask.reshape(-1, 1).to(expert.device, torch.float64).expand_as(expert))
        rows.append(torch.zeros(block.e_score_correction_bias.shape[0], dtype=torch.float64,
                                device=expert.device).scatter_add_(
            0, expert.reshape(-1), weight.reshape(-1)))
    return torch.stack(rows)


@torch.no_grad()
def update_score_bias(model: nn.Module, loads_LE: torch.Tensor, speed: float) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437 §2.1.2), after an
    optimizer step: per MoE layer l and expert i,

        b_l,i += speed * sign(mean_j load_l,j - load_l,i)

    with `loads_LE` the step's tokens per expert (`expert_loads`, summed over micro-batches and
    data-parallel ranks): an overloaded expert's bias goes down, an underloaded one's up, so it
    is chosen less or more often; the gating weights never see the bias."""
    blocks = score_bias_blocks(model)
    assert loads_LE.shape[0] == len(blocks), (tuple(loads_LE.shape), len(blocks))
    for block, load_E in zip(blocks, loads_LE):
        bias = block.e_score_correction_bias
        step = speed * torch.sign(load_E.mean() - load_E)
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))


def max_load_violation(loads_LE: torch.Tensor) -> float:
    """The paper's MaxVio averaged over layers: max_i load_i / mean_i load_i - 1 (0 when
    perfectly balanced)."""
    mean_L = loads_LE.mean(dim=1).clamp_min(1e-12)
    return float((loads_LE.max(dim=1).values / mean_L - 1).mean())
