"""Context parallelism: one packed row split over the ranks of a "cp" group, attention exact
across the split.

Split (load-balanced for causal attention). A row of T tokens is cut into 2 cp chunks of
T / (2 cp); rank r holds chunks r and 2 cp - 1 - r, so every rank holds one early and one late
chunk and the causal work (a query sees the keys before it) is the same on every rank. Every
per-token tensor of a batch (ids, labels, positions, masks, advantages) is cut the same way
(`CPShard.local`); the loss over a rank's tokens is a part of the row's loss, and the parts add
up over the group (FSDP reduces the gradients over it).

Attention (all-gather of K/V per layer). Each rank projects q, k, v for its tokens, gathers
every rank's k and v (`gather_sequence`: all-gather forward; in backward each rank takes the
gradient of its own keys and values, summed over the group's queries) and attends from its
queries to all T keys under the row's mask in global positions: same document (documents may
span chunks and ranks), causal, in the sliding window; soft-capping and sinks as in
`posttrain.ops.attention`. The mask is [B, 1, T / cp, T]; this is the explicit path (every
device), memory O(T^2 / cp) per layer call.

Positions. RoPE takes each token's position in its document, computed on the whole row and cut
like the tokens, so a document that spans ranks is rotated as it is in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CPShard", "cp_attention_mask", "gather_sequence"]


@dataclass(frozen=True)
class CPShard:
    """Rank `rank` of a context-parallel group of `size` over rows of `seq_len` tokens."""

    rank: int
    size: int
    seq_len: int
    group: object = None          # the "cp" process group (None: one process, for tests)

    def __post_init__(self) -> None:
        if self.seq_len % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks cuts rows into "
                             f"{2 * self.size} chunks: rows of {self.seq_len} tokens do not "
                             f"divide; make the pack length a multiple of {2 * self.size}")

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.size)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """The global positions [T / cp] of `rank`'s tokens (default: this rank's), in the
        order they are held: chunk r, then chunk 2 cp - 1 - r."""
        r = self.rank if rank is None else rank
        c = self.chunk
        first = torch.arange(r * c, (r + 1) * c)
        second = torch.arange((2 * self.size - 1 - r) * c, (2 * self.size - r) * c)
        return torch.cat([first, second])

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a per-token tensor of full rows ([B, T, ...] on `dim`)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"context parallelism: a tensor of {x.shape[dim]} tokens on dim "
                             f"{dim}, rows have {self.seq_len}")
        return x.index_select(dim, self.positions().to(x.device))

    def gather_order(self, device: torch.device) -> torch.Tensor:
        """[T]: for each global position, its index in the rank-major concatenation of every
        rank's local tokens (what `gather_sequence` reorders by)."""
        held = torch.cat([self.positions(r) for r in range(self.size)])
        return torch.empty_like(held).index_copy_(0, held, torch.arange(held.numel())).to(device)


class _GatherSequence(torch.autograd.Function):
    """All-gather of per-rank sequence pieces along `dim` into global order; backward sums the
    full gradient over the group and returns each rank its own positions' part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: CPShard, dim: int) -> torch.Tensor:
        ctx.shard, ctx.dim = shard, dim
        pieces = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(pieces, x.contiguous(), group=shard.group)
        joined = torch.cat(pieces, dim=dim)
        return joined.index_select(dim, shard.gather_order(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shard, dim = ctx.shard, ctx.dim
        total = grad.contiguous()
        dist.all_reduce(total, group=shard.group)
        return total.index_select(dim, shard.positions().to(grad.device)), None, None


def gather_sequence(x: torch.Tensor, shard: CPShard, dim: int = 2) -> torch.Tensor:
    """Every rank's tokens of `x` (this rank's [..., T / cp, ...] on `dim`) as the whole row
    [..., T, ...] in global order, differentiable (each rank's gradient is the sum over the
    group's uses of its tokens)."""
    if shard.size == 1:
        return x
    return _GatherSequence.apply(x, shard, dim)


def cp_attention_mask(document_ids_BT: torch.Tensor, shard: CPShard,
                      window: int | None = None) -> torch.Tensor:
    """[B, 1, T / cp, T] bool: this rank's queries (global positions i) may attend key j when
    both are in the same document, j <= i, and i - window < j."""
    query_pos = shard.positions().to(document_ids_BT.device)
    key_pos = torch.arange(shard.seq_len, device=document_ids_BT.device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    same_doc = document_ids_BT[:, query_pos, None] == document_ids_BT[:, None, :]
    return (allowed[None] & same_doc)[:, None]
