"""Supervised fine-tuning loss: token-level cross-entropy on the loss-masked targets.

    loss = - (1 / N_global) * sum_{t : labels_t != -100} log p(labels_t | x_<=t)

`labels` are already shifted and masked by the data layer (`posttrain.data.packing`), so the
same formula serves packed and padded rows. The normalizer is the number of loss tokens in the
whole optimizer step over all ranks and micro-batches (not per micro-batch), so gradient
accumulation and data parallelism give the same gradient as one big batch: every target token
weighs the same, however the step is split.
"""

from __future__ import annotations

import torch

from posttrain.ops.cross_entropy import chunked_cross_entropy


def sft_loss_sum(hidden_BTH: torch.Tensor, head_weight_VH: torch.Tensor, labels_BT: torch.Tensor,
                 *, real_vocab_size: int, chunk_tokens: int = 1024,
                 softcap: float | None = None) -> torch.Tensor:
    """Sum over target tokens of -log p (fp32); divide by the step's global token count."""
    return chunked_cross_entropy(hidden_BTH, head_weight_VH, labels_BT,
                                 real_vocab_size=real_vocab_size, chunk_tokens=chunk_tokens,
                                 reduction="sum", softcap=softcap)
