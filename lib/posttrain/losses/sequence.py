"""Losses of models trained on event sequences: the next item plus per-position heads.

With final hidden states h_t, the objective of one optimizer step is

    L = (1 / N) * [ w_0 * sum_{t in T} -log softmax(W h_t)[x_{t+1}]
                    + sum_k w_k * sum_{t in L_k} l_k(t) ]

    l_k(t) = -log softmax(W_k h_t + b_k)[y_{k,t}]     classification head k
    l_k(t) = (w_k . h_t + b_k - y_{k,t})^2             regression head k (squared error)

T: the next-item targets (positions whose next token is in the same document; the chunked
cross-entropy of `posttrain.ops.cross_entropy` over the LM head W, as in SFT). L_k: the positions
where head k has a label, y_{k,t} being the label of event t + 1 (``target: next``) or of event t
(``target: current``); positions without one are left out. N is the step's global number of
next-item targets (the engine's N_global), so the gradient does not depend on how the step was
split over micro-batches and ranks, and a head's term weighs each labelled position like one
next-item target: with a label on every event it is w_k times the head's mean loss.

The functions here are pure: `shift_to_next` aligns labels with the position that predicts them,
`labelled` masks the positions with a label, `head_loss_sum` is one head's sum over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.config.data import TargetKind, check_kind
from posttrain.ops.cross_entropy import IGNORE_INDEX

__all__ = ["check_kind", "head_loss_sum", "labelled", "missing_value", "shift_to_next",
           "TargetKind"]



def missing_value(dtype: torch.dtype) -> float:
    """What a label tensor holds where there is no label: NaN (float), else -100."""
    return float("nan") if dtype.is_floating_point else IGNORE_INDEX


def labelled(target: torch.Tensor) -> torch.Tensor:
    """Bool mask of the positions that hold a label."""
    if target.dtype.is_floating_point:
        return ~torch.isnan(target)
    return target != IGNORE_INDEX


def shift_to_next(values_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = values[b, t + 1]`` where t + 1 is in the same document as t (its position
    id is one more), the missing value elsewhere (a document's last token, the pad tail)."""
    out = torch.full_like(values_BT, missing_value(values_BT.dtype))
    same_doc = position_ids_BT[:, 1:] == position_ids_BT[:, :-1] + 1
    out[:, :-1] = torch.where(same_doc, values_BT[:, 1:], out[:, 1:])
    return out


def head_loss_sum(kind: TargetKind, out: torch.Tensor,
                  target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One head's loss summed over K labelled positions (fp32), and for a classification head
    the number of them its argmax gets right (None for regression).

    `out`: logits [K, C] or values [K]; `target`: class ids [K] or values [K]."""
    if kind == "classification":
        loss = F.cross_entropy(out.float(), target.long(), reduction="sum")
        correct = (out.detach().argmax(dim=-1) == target).sum()
        return loss, correct
    return (out.float() - target.float()).square().sum(), None
