"""Expert parallelism: the (token, expert) pairs of a MoE layer sent to the ranks that own their
experts and the outputs sent back, with two all-to-alls per direction.

Layout. The `ep` ranks of an expert group each hold `E / ep` of the layer's experts, rank j
experts [j E/ep, (j+1) E/ep) (`apply_expert_parallel` in `posttrain.distributed.parallelize`
shards the stacked weights on their expert dim). Every rank routes its own tokens.

One layer's dispatch (`run_on_owners`), given this rank's pairs sorted by global expert id (so
already grouped by owner rank) and their counts per expert `counts_E`:

1. the counts are exchanged (`all_to_all_single` of [ep, E/ep] int64): each rank learns how
   many rows every other rank sends to each of its experts;
2. the rows go to their owners (`all_to_all_single`, uneven splits); they arrive ordered by
   source rank, then expert, and are regrouped by local expert (a stable sort) so that the
   experts run as one grouped matmul (or one loop) over exactly their rows;
3. the outputs are put back in arrival order and returned to their sources by the reverse
   all-to-all, where the caller weights and sums them as without expert parallelism.

Backward is the same exchanges in reverse (`_AllToAll`), the splits swapped; the counts are
not differentiated. A rank that routes nothing to some expert, or an expert that receives no
rows at all, costs nothing: empty splits and empty groups. Every rank of the group must run
the same layers in the same order (as it does under FSDP): each dispatch is a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EPGroup", "run_on_owners"]

# (this rank's index in the expert group, the group's size, its process group)
EPGroup = tuple[int, int, Any]


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent in blocks of `send` rows to the group's ranks in order; returns the
    blocks of `recv` rows received from them. Backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int],
                group: Any) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(grad.contiguous(), ctx.send, ctx.recv, ctx.group), None, None, None


def run_on_owners(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                  x_sorted: torch.Tensor, counts_E: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """This rank's pair rows `x_sorted` [N, H] (sorted by global expert id, `counts_E` [E] rows
    per expert) run by their experts' owners; returns their outputs [N, H'] in the same order.

    `run(x, local_expert, counts)` runs this rank's experts over rows sorted by local expert id
    (`local_expert` [M] in [0, E/ep), `counts` [E/ep]), as the experts module does without
    expert parallelism.
    """
    _, size, group = ep
    local = counts_E.numel() // size
    send_RL = counts_E.view(size, local).contiguous()          # [destination, its expert]
    recv_RL = torch.empty_like(send_RL)                        # [source, my expert]
    dist.all_to_all_single(recv_RL, send_RL, group=group)
    send, recv = send_RL.sum(1).tolist(), recv_RL.sum(1).tolist()
    x_recv = _AllToAll.apply(x_sorted, recv, send, group)
    # arrived by source rank, then local expert: regroup by local expert
    expert_recv = torch.arange(local, device=x_sorted.device).repeat(size).repeat_interleave(
        recv_RL.reshape(-1).to(x_sorted.device))
    order = torch.argsort(expert_recv, stable=True)
    y = run(x_recv.index_select(0, order), expert_recv[order], recv_RL.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(y.index_select(0, back), send, recv, group)
